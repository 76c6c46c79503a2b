"""FP8 (w8a8) linear layers: quantised when the model loads (`--quantization fp8`), or read
from an FP8 checkpoint (compressed-tensors; block-wise ones are dequantised instead, see
Fp8Checkpoint).

Weights: float8_e4m3fn with one float32 scale per output channel, so they take half the
memory of bfloat16 and half the bytes a decode step reads. Activations: quantised per token
when each layer runs (dynamic scales, no calibration). On CUDA in bfloat16 the product runs on
the FP8 tensor cores: up to FEW_ROWS rows on mmserve/kernels/fp8_gemm.py, more on torch._scaled_mm with
row-wise scales; elsewhere, and for other compute dtypes, the same FP8 operands are multiplied
in float32 and scaled: the reference the CUDA path is tested against.

Quantised: every projection inside the decoder layers (q/k/v, o, gate/up, down), a VLM's
language model's included. Kept in the model dtype: embeddings, norms, the LM head (as vLLM's
fp8 does) and image towers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models.base import Fp8Model, ModelBase
from mmserve.models.gguf_cache import materialize
from mmserve.models.layers import load_into
from mmserve.models.quantized_input import InputQuant, QuantizedActivation, W8A8Linear
from mmserve.models.registry import architecture_of, get_model_class
from mmserve.models.source import load_hf_config, resolve_model_source

logger = logging.getLogger(__name__)
# mmserve.kernels.* are imported where used: a Triton kernel module imported before the tests
# set TRITON_INTERPRET=1 would be compiled for a GPU the CPU machine does not have
FP8_DTYPE = torch.float8_e4m3fn
QUANTIZATION_METHODS = ("fp8", "int8")  # int8: models/int8.py
_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper onwards
# products of up to this many rows run on mmserve/kernels/fp8_gemm.py: on the H200 it beats
# torch._scaled_mm on Llama-3-8B's projections at 1-16 rows (1.2-1.8x at 16) and, summed over a
# layer's four, at 17-32 (102 vs 108 us at 32 rows) and at 48 and 64 (its 64-row tile: 83 vs
# 103 us at 64, the down projection 22 vs 36); the batch-64 decode step at 1k context 6.05 ms
# against 6.74 with 32 here (H200, session 31, BENCHMARKS.md). INT8's products (models/int8.py)
# take the same rows kernel up to the same count: its decode step at 1k context 6.35 against
# 7.42 ms at batch 48 and 7.12 against 8.07 at batch 64 with 32 here (H100, session 32)
FEW_ROWS = 64
# more rows: torch._scaled_mm (CUTLASS's row-wise kernel). INT8's tiled Triton GEMM on FP8
# operands (float32 sums promoted every K step) lost to it at every shape on the H200 (256-4,096
# rows of the 8B shape's projections, e.g. 565 against 376 us for down at 4,096 rows; offline
# throughput 7,197 against 8,798 tok/s, session 15), and was removed
_ALIGN = 16  # torch._scaled_mm wants both matrix dimensions in multiples of 16
# torch._scaled_mm on more than PAD_ABOVE rows that are not a multiple of PAD_ROWS: the rows
# first copied into a buffer of the next multiple (its tail rows left as they are: each output
# row reads only its own input row, and the tail's are dropped). On the H200 at 518 and 1,030
# rows (a 512- or 1,024-token prefill beside a few decodes) the copy and the product together
# beat the product alone: gate_up 156 -> 123 us and 242 -> 224, down 88 -> 85 and 147 -> 136,
# qkv 34 -> 30 and 63 -> 59 (o about even), session 15, scripts/fp8_kernels.py; at 256 rows and
# at multiples of 128 the copy only costs (~2.6 us). 0: never padded.
PAD_ROWS = 128
PAD_ABOVE = 256


class Fp8Linear(W8A8Linear):
    """y = x W^T + b with W in float8_e4m3fn (per-output-channel scales) and x quantised to FP8
    on the fly: per token, or with the checkpoint's static input_scale when it has one."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        input_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)  # [N, K] float8_e4m3fn
        self.weight_scale = nn.Parameter(weight_scale.reshape(-1), requires_grad=False)  # [N] fp32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.input_scale = (  # [1] fp32: static activation scale; None = per token
            None
            if input_scale is None
            else nn.Parameter(input_scale.reshape(1), requires_grad=False)
        )
        self._input_quant: InputQuant | None = None  # (input_quant's, made on first use)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        from mmserve.kernels.quant import quantize_weight_fp8

        weight, scale = quantize_weight_fp8(linear.weight.data)
        bias = None if linear.bias is None else linear.bias.data
        return cls(weight, scale, bias)

    @classmethod
    def empty_like(cls, linear: nn.Linear, static_input: bool) -> Fp8Linear:
        """Zeros in the shapes an FP8 checkpoint fills (the bias keeps the model dtype)."""
        device = linear.weight.device
        n, k = linear.out_features, linear.in_features
        bias = None if linear.bias is None else torch.zeros_like(linear.bias)
        input_scale = torch.zeros(1, device=device) if static_input else None
        weight = torch.zeros(n, k, device=device, dtype=FP8_DTYPE)
        return cls(weight, torch.zeros(n, device=device), bias, input_scale)

    @property
    def input_quant(self) -> InputQuant:
        # the FP8 tensor cores' path is bfloat16's; other dtypes run the float32 reference.
        # Made once per input_scale (a load may put a new Parameter there)
        made = self._input_quant
        if made is None or made.static_scale is not self.input_scale:
            made = self._input_quant = InputQuant(FP8_DTYPE, self.input_scale, kernel_dtypes=(torch.bfloat16,))
        return made

    def product(self, xq: QuantizedActivation) -> torch.Tensor:
        if xq.q.is_cuda and xq.dtype == torch.bfloat16:
            return self._scaled_mm(xq.q, xq.scale)
        from mmserve.kernels.fp8_gemm import fp8_gemm_rows_ref

        w_scale = self.weight_scale.view(1, -1)
        return fp8_gemm_rows_ref(xq.q, xq.scale, self.weight, w_scale).to(xq.dtype)

    def _scaled_mm(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """On the FP8 tensor cores: a few rows (decode) by our kernel, which reads the weights
        at the memory's speed; more by torch._scaled_mm (CUTLASS)."""
        from mmserve.kernels.fp8_gemm import few_rows_product

        if q.shape[0] == 0:
            return q.new_empty((0, self.out_features), dtype=torch.bfloat16)
        w_scale = self.weight_scale.view(1, -1)
        if q.shape[0] <= FEW_ROWS:
            return few_rows_product(q, scale, self.weight, w_scale, torch.bfloat16)
        rows = q.shape[0]
        if PAD_ROWS and rows > PAD_ABOVE and rows % PAD_ROWS:
            padded = -(-rows // PAD_ROWS) * PAD_ROWS
            q_padded = q.new_empty((padded, q.shape[1]))
            scale_padded = scale.new_empty((padded, 1))
            q_padded[:rows] = q
            scale_padded[:rows] = scale.view(rows, 1)
            out = torch._scaled_mm(
                q_padded, self.weight.t(), scale_a=scale_padded, scale_b=w_scale, out_dtype=torch.bfloat16
            )
            return out[:rows]
        return torch._scaled_mm(
            q, self.weight.t(), scale_a=scale, scale_b=w_scale, out_dtype=torch.bfloat16
        )

    def extra_repr(self) -> str:
        acts = "static" if self.input_scale is not None else "per token"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8, activations {acts}"


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [T, N]: x quantised (per token, or by the static input_scale), the FP8 operands
    multiplied in fp32, then scaled by the token's and the output channel's scales (as the FP8
    GEMM does)."""
    from mmserve.kernels.fp8_gemm import fp8_gemm_rows_ref
    from mmserve.kernels.quant import per_token_quant_ref

    q, scale = per_token_quant_ref(x, static_scale=input_scale)
    out = fp8_gemm_rows_ref(q, scale, weight, weight_scale.view(1, -1))
    return out if bias is None else out + bias.float()


def check_quantization(method: str | None, device: torch.device) -> None:
    """A bad method, or FP8 on a GPU without FP8 tensor cores, fails naming the field."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise InvalidArgument(
            "quantization", f"{method!r} is not one of {list(QUANTIZATION_METHODS)}"
        )
    if method == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < _MIN_CAPABILITY:
        raise InvalidArgument(
            "quantization",
            f"fp8 needs a GPU of compute capability 8.9 or later ({torch.cuda.get_device_name(device)})",
        )


@torch.no_grad()
def quantize_fp8(model: ModelBase) -> int:
    """Replaces the projections of the model's decoder layers by Fp8Linear quantised from
    their weights, one at a time (at most one layer's weights exist twice); returns how many
    were replaced."""
    return replace_projections(model, Fp8Linear.from_linear)


@torch.no_grad()
def prepare_fp8_checkpoint(model: ModelBase, checkpoint: Fp8Checkpoint) -> int:
    """Before an FP8 checkpoint's weights load: the projections become empty Fp8Linear for
    load_scale and the weight loader to fill."""
    return replace_projections(
        model, lambda linear: Fp8Linear.empty_like(linear, checkpoint.static_activations)
    )


def replace_projections(
    model: ModelBase, make: Callable[[nn.Linear], nn.Module], method: str = "fp8"
) -> int:
    if not model.capabilities.supports_fp8:
        raise UnsupportedModel(
            f"quantization {method} is supported for Llama-family decoders and the VLMs built on "
            f"them, not {type(model).__name__}"
        )
    replaced = 0
    for layer in cast(Fp8Model, model).decoder_layers():  # a VLM's language model's
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                if method == "fp8" and (child.in_features % _ALIGN or child.out_features % _ALIGN):
                    raise UnsupportedModel(
                        f"quantization fp8 needs layer sizes in multiples of {_ALIGN}; "
                        f"{name} is {child.out_features} x {child.in_features}"
                    )
                setattr(parent, name, make(child))
                replaced += 1
    cast(Fp8Model, model).fuse_input_quant()
    param = next(model.parameters())
    if param.is_cuda:
        torch.cuda.empty_cache()  # the freed weights go back to the KV cache's budget
    if method == "fp8" and (not param.is_cuda or param.dtype != torch.bfloat16):
        logger.warning(
            "fp8 in %s on %s: FP8 products run on CUDA tensor cores in bfloat16 only; here each "
            "runs as the float32 reference (exact, but slower than unquantised)",
            param.dtype,
            param.device.type,
        )
    return replaced


def is_fp8(model: Any) -> bool:  # an nn.Module
    return any(p.dtype == FP8_DTYPE for p in model.parameters())


def load_scale(param: torch.Tensor, tensor: torch.Tensor, name: str, rows: slice | None) -> None:
    """Loads a checkpoint's weight_scale or input_scale into an Fp8Linear's (rows: the part
    of a merged projection). A per-tensor weight scale becomes that part's per-channel scales;
    the parts of a merged projection share one input, so it takes the largest input scale."""
    tensor = tensor.detach().float().reshape(-1)
    if name.endswith("input_scale"):
        if tensor.numel() != 1:
            raise UnsupportedModel(
                f"{name}: a static input scale has one element, got {tensor.numel()}"
            )
        param.data.copy_(torch.maximum(param.data, tensor.to(param.device)))
        return
    if tensor.numel() == 1:  # per tensor: the same scale for each channel of the part
        tensor = tensor.expand((param.data if rows is None else param.data[rows]).shape[0])
    load_into(param, tensor, name, rows)


def supports_quantization(model_path: str) -> bool:
    """Whether the checkpoint at model_path is of an architecture quantize_fp8 handles (read
    from its config; nothing is loaded)."""
    # a GGUF's config is read from its converted folder (made once, loaded from right after)
    hf_config = load_hf_config(materialize(resolve_model_source(model_path), weights=False))
    return get_model_class(architecture_of(hf_config)).capabilities.supports_fp8


@dataclass(frozen=True)
class Fp8Checkpoint:
    """An FP8 checkpoint: compressed-tensors (llm-compressor's FP8 and FP8-dynamic: weights
    float8_e4m3fn with per-channel or per-tensor weight_scale), loaded as FP8; or transformers'
    block-wise "fp8" (as Qwen3-FP8 ships: weight_scale_inv per block of weights), whose
    weights are dequantised as they load (no block-scaled GEMM here yet)."""

    static_activations: bool = False  # input_scale per projection (else activations per token)
    block: tuple[int, int] | None = None  # block-wise weight scales: (rows, columns) per block


def checkpoint_fp8(hf_config: Any) -> Fp8Checkpoint | None:
    """The FP8 scheme of a checkpoint's quantization_config; None without one. A scheme we
    cannot run exactly raises UnsupportedModel naming what."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    where = "quantization_config"
    method = qc.get("quant_method")
    if method == "fp8":
        return _block_fp8(qc)
    if method != "compressed-tensors":
        raise UnsupportedModel(
            f"{where}.quant_method {method!r}: FP8 checkpoints (compressed-tensors, or block-wise "
            '"fp8") load; others do not (or load an unquantised checkpoint with --quantization fp8)'
        )
    if qc.get("format") not in ("float-quantized", "naive-quantized"):
        raise UnsupportedModel(f"{where}.format {qc.get('format')!r} is not float-quantized")
    check_kv_cache_scheme(qc)
    ignored = [m for m in qc.get("ignore") or [] if m not in ("lm_head", "re:.*lm_head")]
    if ignored:
        raise UnsupportedModel(f"{where}.ignore {ignored}: only lm_head may stay unquantised")
    group = config_group(qc)
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    if (
        not _is_fp8_args(weights)
        or weights.get("strategy") not in ("channel", "tensor")
        or weights.get("dynamic")
    ):
        raise UnsupportedModel(f"{where} weights {weights}: FP8 per channel or per tensor expected")
    if not acts or not _is_fp8_args(acts):
        raise UnsupportedModel(f"{where} input_activations {acts}: FP8 activations expected (w8a8)")
    dynamic = bool(acts.get("dynamic"))
    if (acts.get("strategy"), dynamic) not in (("token", True), ("tensor", False)):
        raise UnsupportedModel(
            f"{where} input_activations {acts}: dynamic per token or static per tensor expected"
        )
    return Fp8Checkpoint(static_activations=not dynamic)


def check_kv_cache_scheme(qc: dict) -> None:
    """A compressed-tensors kv_cache_scheme is FP8 with one scale per tensor (k_scale /
    v_scale beside each attention, read by models/loader.py and used with --kv-cache-dtype
    fp8), or absent; another scheme raises naming it."""
    scheme = qc.get("kv_cache_scheme")
    if not scheme:
        return
    if (
        not _is_fp8_args(scheme)
        or scheme.get("strategy", "tensor") != "tensor"
        or scheme.get("dynamic")
    ):
        raise UnsupportedModel(
            f"quantization_config.kv_cache_scheme {scheme}: FP8 with static per-tensor scales expected"
        )


def config_group(qc: dict) -> dict:
    """A compressed-tensors quantization_config's one config group, which targets Linear."""
    where = "quantization_config"
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedModel(f"{where}.config_groups: one group expected, got {len(groups)}")
    group: dict = groups[0]
    if "Linear" not in (group.get("targets") or []):
        raise UnsupportedModel(f"{where}.config_groups targets {group.get('targets')} lack Linear")
    return group


def _block_fp8(qc: dict) -> Fp8Checkpoint:
    block = qc.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise UnsupportedModel(
            f"quantization_config.weight_block_size {block!r}: [rows, columns] expected"
        )
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModel(
            f"quantization_config.activation_scheme {qc.get('activation_scheme')!r}: dynamic expected"
        )
    return Fp8Checkpoint(block=(block[0], block[1]))


def dequantize_blocks(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A block-wise FP8 checkpoint's (name, tensor) pairs with each FP8 weight multiplied by
    its weight_scale_inv (one per block of rows x columns; the last blocks may be partial), in
    float32; other tensors pass as they are. A weight waits for its scale (or a scale for its
    weight) whichever comes first."""
    weights_by_name: dict[str, torch.Tensor] = {}
    scales_by_name: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".weight_scale_inv"):
            weight_name = name.removesuffix("_scale_inv")
            if weight_name in weights_by_name:
                yield (
                    weight_name,
                    _dequantize(weight_name, weights_by_name.pop(weight_name), tensor, block),
                )
            else:
                scales_by_name[weight_name] = tensor
        elif tensor.dtype == FP8_DTYPE:
            if name in scales_by_name:
                yield name, _dequantize(name, tensor, scales_by_name.pop(name), block)
            else:
                weights_by_name[name] = tensor
        else:
            yield name, tensor
    unpaired = sorted(weights_by_name) + [f"{n}_scale_inv" for n in sorted(scales_by_name)]
    if unpaired:
        raise UnsupportedModel(
            f"FP8 checkpoint: weights and scales without their pair: {unpaired[:4]}"
        )


def _dequantize(
    name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    rows, cols = q.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != grid:
        raise UnsupportedModel(
            f"{name}_scale_inv: shape {tuple(scale.shape)}, expected {grid} for blocks of {block}"
        )
    full = (
        scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    )
    return q.float() * full


def _is_fp8_args(args: dict) -> bool:
    return args.get("num_bits") == 8 and args.get("type") == "float" and args.get("symmetric", True)
