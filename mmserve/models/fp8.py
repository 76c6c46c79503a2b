"""FP8 (w8a8) linear layers, quantised when the model loads (`--quantization fp8`).

Weights: float8_e4m3fn with one float32 scale per output channel, so they take half the
memory of bfloat16 and half the bytes a decode step reads. Activations: quantised per token
when each layer runs (dynamic scales, no calibration). On CUDA in bfloat16 the product runs on
the FP8 tensor cores: up to FEW_ROWS rows on kernels/fp8_gemm.py, more on torch._scaled_mm with
row-wise scales; elsewhere, and for other compute dtypes, the same FP8 operands are multiplied
in float32 and scaled: the reference the CUDA path is tested against.

Quantised: every projection inside the decoder layers (q/k/v, o, gate/up, down). Kept in the
model dtype: embeddings, norms and the LM head (as vLLM's fp8 does).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.kernels.quant import FP8_DTYPE, per_token_quant_ref, quantize_weight_fp8

logger = logging.getLogger(__name__)
QUANTIZATION_METHODS = ("fp8",)
_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper onwards
# products of up to this many rows run on kernels/fp8_gemm.py: on the H200 it beats
# torch._scaled_mm on Llama-3-8B's projections at 1-32 rows (1.2-1.8x at 16)
FEW_ROWS = 32
_ALIGN = 16  # torch._scaled_mm wants both matrix dimensions in multiples of 16


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in float8_e4m3fn (per-output-channel scales) and x quantised per
    token on the fly."""

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)  # [N, K] float8_e4m3fn
        self.weight_scale = nn.Parameter(
            weight_scale.view(1, -1), requires_grad=False
        )  # [1, N] fp32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        weight, scale = quantize_weight_fp8(linear.weight.data)
        bias = None if linear.bias is None else linear.bias.data
        return cls(weight, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda and x2.dtype == torch.bfloat16:
            out = self._scaled_mm(x2)
        else:
            out = fp8_linear_ref(x2, self.weight, self.weight_scale, None).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """On the FP8 tensor cores: a few rows (decode) by our kernel, which reads the weights
        at the memory's speed; more by torch._scaled_mm (CUTLASS)."""
        from mmserve.kernels.fp8_gemm import fp8_gemm_rows
        from mmserve.kernels.quant import per_token_quant_fp8

        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        q, scale = per_token_quant_fp8(x)
        if x.shape[0] <= FEW_ROWS:
            return fp8_gemm_rows(q, scale, self.weight, self.weight_scale)
        return torch._scaled_mm(
            q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=torch.bfloat16
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """float32 [T, N]: x quantised per token, the FP8 operands multiplied in fp32, then scaled
    by the token's and the output channel's scales (as the FP8 GEMM does)."""
    q, scale = per_token_quant_ref(x)
    out = (q.float() @ weight.float().t()) * scale * weight_scale.view(1, -1)
    return out if bias is None else out + bias.float()


def check_quantization(method: str | None, device: torch.device) -> None:
    """A bad method, or FP8 on a GPU without FP8 tensor cores, fails naming the field."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise InvalidArgument(
            "quantization", f"{method!r} is not one of {list(QUANTIZATION_METHODS)}"
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < _MIN_CAPABILITY:
        raise InvalidArgument(
            "quantization",
            f"fp8 needs a GPU of compute capability 8.9 or later ({torch.cuda.get_device_name(device)})",
        )


@torch.no_grad()
def quantize_fp8(model: nn.Module) -> int:
    """Replaces the projections of the model's decoder layers by Fp8Linear, one at a time (so
    at most one layer's weights exist twice); returns how many were replaced."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not getattr(model, "supports_fp8", False) or layers is None:
        raise UnsupportedModel(
            f"quantization fp8 is supported for Llama-family decoders, not {type(model).__name__}"
        )
    replaced = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                if child.in_features % _ALIGN or child.out_features % _ALIGN:
                    raise UnsupportedModel(
                        f"quantization fp8 needs layer sizes in multiples of {_ALIGN}; "
                        f"{name} is {child.out_features} x {child.in_features}"
                    )
                setattr(parent, name, Fp8Linear.from_linear(child))
                replaced += 1
    param = next(model.parameters())
    if param.is_cuda:
        torch.cuda.empty_cache()  # the freed weights go back to the KV cache's budget
        if param.dtype != torch.bfloat16:
            logger.warning(
                "fp8 in %s on CUDA: the FP8 tensor cores take bfloat16 only, so each product "
                "runs as the float32 reference (slow; for tests)",
                param.dtype,
            )
    return replaced


def is_fp8(model: nn.Module) -> bool:
    return any(p.dtype == FP8_DTYPE for p in model.parameters())


def supports_quantization(model_path: str) -> bool:
    """Whether the checkpoint at model_path is of an architecture quantize_fp8 handles (read
    from its config; nothing is loaded)."""
    from mmserve.models.loader import load_hf_config, resolve_model_source
    from mmserve.models.registry import architecture_of, get_model_class

    hf_config = load_hf_config(resolve_model_source(model_path))
    return bool(getattr(get_model_class(architecture_of(hf_config)), "supports_fp8", False))
