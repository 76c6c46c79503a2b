"""INT8 w8a8 linear layers (`--quantization int8`): the projections of a Llama-family decoder
quantised when the model loads, as SmoothQuant / llm-compressor's W8A8 run them.

Weights: int8 in [-127, 127] with one float32 scale per output channel (absmax / 127);
activations: int8 per token, quantised when each layer runs (dynamic, no calibration). The
product is exact integer arithmetic, scaled by the token's and the channel's scales: on CUDA
through Triton kernels (activation quantisation; decode-sized products; a tiled INT8 GEMM with
the scales in its epilogue for larger ones, or torch._int_mm: LARGE_GEMM), elsewhere in float64
(exact for any K this engine meets). Embeddings, norms, the LM head and image towers stay in the
model's dtype, as with FP8."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmserve.errors import UnsupportedModel
from mmserve.kernels.quant import per_token_quant_ref
from mmserve.models.base import ModelBase
from mmserve.models.fp8 import FEW_ROWS, check_kv_cache_scheme, config_group, replace_projections
from mmserve.models.quantized_input import InputQuant, QuantizedActivation, W8A8Linear

_ALIGN = 8  # ... and both matrix dimensions in multiples of 8


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (int8 [R, K], float32 [R, 1]): each row symmetric, absmax / 127, rounded
    half to even (mmserve/kernels/quant.py's INT8 scheme)."""
    return per_token_quant_ref(x, torch.int8)


def int8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """float32 [T, N]: x quantised per token, the int8 products summed exactly (float64),
    scaled by the token's and the output channel's scales (what the INT8 GEMM computes)."""
    return int8_product_ref(*quantize_rows(x), weight, weight_scale)


def int8_product_ref(
    q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """float32 [T, N]: int8 q [T, K] (scales [T, 1]) times the int8 weight, summed exactly."""
    acc = q.double() @ weight.double().t()
    return (acc * scale.double() * weight_scale.double().view(1, -1)).float()


# the product of more than FEW_ROWS rows on CUDA: "int_mm" (torch._int_mm, then one pass that scales its
# int32 sums) or "triton" (mmserve/kernels/int8_gemm.py, the scales in its epilogue). On the H200 the
# Triton kernel measured faster at every prefill size of the 8B shape but one (256 rows of
# o_proj: 438 against 502 TOP/s), and 866-957 TOP/s against 733-875 at 4096 rows (session 13,
# before its tiling was tuned); offline throughput 7,815 against 6,894 tok/s
LARGE_GEMM = "triton"


_INT8_INPUT = InputQuant(torch.int8)  # (every INT8 projection's: per token, dynamic)


class Int8Linear(W8A8Linear):
    """y = x W^T + b with W int8 (per-output-channel scales) and x quantised per token."""

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)  # [N, K] int8
        self.weight_scale = nn.Parameter(weight_scale.reshape(-1).float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def empty_like(cls, linear: nn.Linear) -> Int8Linear:
        """Zeros in the shapes an INT8 checkpoint fills (the bias keeps the model dtype)."""
        device = linear.weight.device
        n, k = linear.out_features, linear.in_features
        bias = None if linear.bias is None else torch.zeros_like(linear.bias)
        weight = torch.zeros(n, k, device=device, dtype=torch.int8)
        return cls(weight, torch.zeros(n, device=device), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        weight, scale = quantize_rows(linear.weight.data)
        bias = None if linear.bias is None else linear.bias.data
        return cls(weight, scale, bias)

    @property
    def input_quant(self) -> InputQuant:
        return _INT8_INPUT

    def product(self, xq: QuantizedActivation) -> torch.Tensor:
        if xq.q.is_cuda and not (self.in_features % _ALIGN or self.out_features % _ALIGN):
            return self._int_mm(xq.q, xq.scale, xq.dtype)
        return int8_product_ref(xq.q, xq.scale, self.weight, self.weight_scale).to(xq.dtype)

    def _int_mm(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """On the INT8 tensor cores: a few rows (decode) by the rows kernel FP8 uses (the
        weights read once, the scales applied in it), more by torch._int_mm and one pass that
        scales its int32 sums."""
        from mmserve.kernels.fp8_gemm import few_rows_product, scale_product

        rows = q.shape[0]
        if rows == 0:
            return q.new_empty((0, self.out_features), dtype=dtype)
        w_scale = self.weight_scale.view(1, -1)
        if rows <= FEW_ROWS:
            return few_rows_product(q, scale, self.weight, w_scale, dtype)
        if LARGE_GEMM == "triton":
            from mmserve.kernels.int8_gemm import int8_gemm

            return int8_gemm(q, scale, self.weight, w_scale, out_dtype=dtype)
        acc = torch._int_mm(q, self.weight.t())  # int32 (more than 16 rows, as it needs)
        return scale_product(acc, scale, w_scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 w8a8"


@torch.no_grad()
def prepare_int8_checkpoint(model: ModelBase) -> int:
    """prepare_fp8_checkpoint's INT8: empty Int8Linear projections for the checkpoint."""
    return replace_projections(model, Int8Linear.empty_like, "int8")


@torch.no_grad()
def quantize_int8(model: ModelBase) -> int:
    """quantize_fp8's INT8 w8a8 (models/int8.py): every decoder projection an Int8Linear."""
    return replace_projections(model, Int8Linear.from_linear, "int8")


def is_int8(model: Any) -> bool:  # an nn.Module
    return any(isinstance(m, Int8Linear) for m in model.modules())


def checkpoint_int8(hf_config: Any) -> bool:
    """Whether a checkpoint is compressed-tensors INT8 w8a8 as llm-compressor writes it
    (SmoothQuant / W8A8: int8 weights per channel, activations int8 per token, dynamic);
    another int8 scheme raises naming the field."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return False
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "int-quantized":
        return False
    where = "quantization_config"
    group = config_group(qc)
    weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
    if (weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")) != (
        8,
        "int",
        "channel",
    ) or not weights.get("symmetric", True):
        raise UnsupportedModel(f"{where} weights {weights}: int8 per channel, symmetric expected")
    if (
        acts.get("num_bits"),
        acts.get("type", "int"),
        acts.get("strategy"),
        bool(acts.get("dynamic")),
    ) != (8, "int", "token", True) or not acts.get("symmetric", True):
        raise UnsupportedModel(
            f"{where} input_activations {acts}: int8 per token, dynamic, symmetric expected"
        )
    check_kv_cache_scheme(qc)
    return True
