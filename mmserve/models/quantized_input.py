"""Activations handed to a w8a8 projection already quantised.

A w8a8 projection (models/int8.py's Int8Linear, models/fp8.py's Fp8Linear) quantises its input
per token. With FUSE_ACTIVATION_QUANT on, the RMSNorm or the SiLU-and-mul that computes that
input quantises it instead, in the same kernel (mmserve/kernels/rmsnorm.py add_rms_norm_quant,
mmserve/kernels/activation.py silu_and_mul_quant), and hands over a QuantizedActivation: one kernel
launch and one write and read of the model-dtype activation fewer per projection fed (qkv,
gate_up and down; o's input comes from attention). The values are bit for bit those of the
unfused path: the fused kernels quantise the output rounded to the model dtype, as the
projection's own quantisation sees it.

The switch is read when the projections are swapped (models/fp8.py replace_projections calls
the model's fuse_input_quant): set it before a model loads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

# on: scripts/bench_fused_quant.py on the H200 (session 14) measured the fused kernels 1.24-1.74x
# the unfused pair (add_rms_norm_quant 2.97 vs 4.45 us at 1 row, 4096 wide; silu_and_mul_quant
# 6.57 vs 8.38 us at 1 row, 14,336 wide), int8 and fp8 alike, 1 to 8,192 rows
FUSE_ACTIVATION_QUANT = True

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# (slots, not frozen: one is made per projection call, and a frozen dataclass costs ~1.5 us more)
@dataclass(eq=False, slots=True)
class QuantizedActivation:
    """An activation x [..., K] of the model dtype, quantised per token: x[t] ~= q[t] * scale[t]."""

    q: torch.Tensor  # [T, K] int8 or float8_e4m3fn; T: x's leading dimensions flattened
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # x's dtype (the projection's output dtype)
    shape: torch.Size  # x's shape [..., K]


@dataclass(eq=False, slots=True)
class InputQuant:
    """How a w8a8 projection quantises its input per token. The projection applies it to a
    model-dtype input; a norm or activation feeding it may apply it to its own output instead,
    in one kernel wherever uses_kernels (the same kernels, so the same bits)."""

    dtype: torch.dtype  # torch.int8 or torch.float8_e4m3fn
    static_scale: torch.Tensor | None = None  # [1] float32: an FP8 checkpoint's input_scale
    kernel_dtypes: tuple[torch.dtype, ...] = _FLOAT_DTYPES  # model dtypes quantised by kernels

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """On CUDA, in a model dtype the projection's kernels take: quantised by a Triton kernel
        (elsewhere by mmserve/kernels/quant.py's torch reference)."""
        return x.is_cuda and x.dtype in self.kernel_dtypes

    def quantize(self, x: torch.Tensor) -> QuantizedActivation:
        """x [..., K] in the model dtype -> its per-token quantisation."""
        from mmserve.kernels.quant import per_token_quant_ref

        x2 = x.reshape(-1, x.shape[-1])
        if not self.uses_kernels(x):
            q, scale = per_token_quant_ref(x2, self.dtype, self.static_scale)
        elif self.dtype == torch.int8:
            from mmserve.kernels.quant import per_token_quant_int8

            q, scale = per_token_quant_int8(x2)
        else:
            from mmserve.kernels.quant import per_token_quant_fp8

            q, scale = per_token_quant_fp8(x2, self.dtype, self.static_scale)
        return QuantizedActivation(q, scale, x.dtype, x.shape)


class W8A8Linear(nn.Module, ABC):
    """y = x W^T + b with x quantised per token (input_quant), or handed over quantised: what
    Int8Linear and Fp8Linear share. A subclass sets input_quant and bias and multiplies."""

    out_features: int
    bias: nn.Parameter | None

    @property
    @abstractmethod
    def input_quant(self) -> InputQuant: ...

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        xq = x if isinstance(x, QuantizedActivation) else self.input_quant.quantize(x)
        out = self.product(xq)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*xq.shape[:-1], self.out_features)

    @abstractmethod
    def product(self, xq: QuantizedActivation) -> torch.Tensor:
        """[T, N] in xq.dtype: the quantised input times the quantised weight, scaled."""


def fused_input_quant(consumer: nn.Module) -> InputQuant | None:
    """What a norm or activation feeding `consumer` writes: its quantised input when consumer is
    a w8a8 projection and FUSE_ACTIVATION_QUANT is on; else None (its model-dtype output)."""
    if FUSE_ACTIVATION_QUANT and isinstance(consumer, W8A8Linear):
        return consumer.input_quant
    return None
