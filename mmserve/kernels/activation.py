"""SiLU-and-multiply for the fused gate_up projection: [..., 2I] -> silu(gate) * up, [..., I];
and the same quantised per token for the w8a8 down projection it feeds (silu_and_mul_quant).

The gate is the first half of the last dimension and up the second (vLLM's layout).
Arithmetic is fp32, rounded once to the input dtype; the quantised output is that of the
rounded value, as mmserve/kernels/quant.py quantises the stored output: bit for bit the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mmserve.kernels._common import check_float, check_same_device, pdl_launch, pdl_wait
from mmserve.kernels.quant import (
    check_static_scale,
    per_token_quant_ref,
    quantize,
    row_quant_params,
    row_scale,
    store_quantized_row,
)

# the quantising kernel keeps a row of up to this many outputs in registers (gate and up read
# once); a wider row takes two passes in blocks of _LOOP_BLOCK: the row's max, then the values,
# the second reading gate and up again (from L2) and recomputing silu. One pass is the faster
# wherever it fits: half the reads, no recomputation (Llama-3-8B's 14336 fits: 16384)
_ROW_IN_REGISTERS = 16384
_LOOP_BLOCK = 4096


@triton.jit
def _silu_mul(x_row_ptr, inter, cols, mask):
    """float32 silu(gate) * up at cols of one row (0 where masked off), unrounded."""
    gate = tl.load(x_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row_ptr + inter + cols, mask=mask, other=0.0).to(tl.float32)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    pdl_wait(PDL)
    out = _silu_mul(x_ptr + row * stride_x, inter, cols, mask)
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(
    q_ptr, scale_ptr, x_ptr, static_scale_ptr, stride_x, inter, q_max, min_scale,
    STATIC: tl.constexpr, ROUND: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One program per row; the values quantised are silu(gate) * up rounded to x's dtype."""
    row = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * inter
    offs = tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    if ONE_BLOCK:  # BLOCK >= inter: the row stays in registers
        mask = offs < inter
        y = _silu_mul(x_row, inter, offs, mask).to(dtype).to(tl.float32)
        store_quantized_row(
            q_row + offs, scale_ptr + row, y, mask, static_scale_ptr, q_max, min_scale,
            STATIC, ROUND,
        )  # fmt: skip
    else:
        if STATIC:
            scale = tl.load(static_scale_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, inter, BLOCK):
                mask = start + offs < inter
                y = _silu_mul(x_row, inter, start + offs, mask).to(dtype).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(y))
            scale = row_scale(tl.max(amax, 0), q_max, min_scale)
        tl.store(scale_ptr + row, scale)
        for start in range(0, inter, BLOCK):
            mask = start + offs < inter
            y = _silu_mul(x_row, inter, start + offs, mask).to(dtype).to(tl.float32)
            q = quantize(y, scale, q_max, ROUND)
            tl.store(q_row + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, **tensors: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """x [..., 2 * I] checked, as rows [R, 2 * I] with contiguous rows; and I."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * intermediate], got shape {list(x.shape)}")
    check_float("x", x)
    check_same_device(x=x, **{name: t for name, t in tensors.items() if t is not None})
    x2 = x.reshape(-1, x.shape[-1])
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), x.shape[-1] // 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> [..., I] = silu(x[..., :I]) * x[..., I:]."""
    x2, inter = _rows(x)
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            out, x2, x2.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1,
            **pdl_launch(x.device),
        )
    return out


def silu_and_mul_quant(
    x: torch.Tensor, out_dtype: torch.dtype, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2 * I] -> (q [rows, I] out_dtype, scale [rows, 1] float32): silu_and_mul(x)
    quantised per token in one kernel, exactly as mmserve/kernels/quant.py's per_token_quant_int8
    (out_dtype int8) or per_token_quant_fp8 (FP8's out dtypes, static_scale) quantise it."""
    q_max, min_scale, round_to_integers = row_quant_params(out_dtype)
    check_static_scale(static_scale)
    x2, inter = _rows(x, static_scale=static_scale)
    rows = x2.shape[0]
    q = torch.empty((rows, inter), dtype=out_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows > 0 and inter > 0:
        block = triton.next_power_of_2(inter)
        one_block = block <= _ROW_IN_REGISTERS
        block = block if one_block else _LOOP_BLOCK
        _silu_and_mul_quant_kernel[(rows,)](
            q, scale, x2, scale if static_scale is None else static_scale,
            x2.stride(0), inter, q_max, min_scale,
            STATIC=static_scale is not None, ROUND=round_to_integers, ONE_BLOCK=one_block,
            BLOCK=block, num_warps=min(16, max(1, block // 512)), **pdl_launch(x.device),
        )  # fmt: skip
    return q, scale


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def silu_and_mul_quant_ref(
    x: torch.Tensor, out_dtype: torch.dtype, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: the unfused references, one after the other."""
    out = silu_and_mul_ref(x)
    return per_token_quant_ref(out.reshape(-1, out.shape[-1]), out_dtype, static_scale)
