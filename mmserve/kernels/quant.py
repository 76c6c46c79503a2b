"""Dynamic per-token FP8 (and INT8) quantisation of activations, for the w8a8 linear layers.

Each row x[t] gets its own scale s[t] = max(|x[t]|) / 448 (448 is float8_e4m3fn's largest
finite value) and q[t] = clamp(x[t] / s[t], -448, 448) rounded to float8_e4m3fn, so that
x[t] ~= q[t] * s[t]. One program per row: a first pass over the row finds its max, a second
quantises it (the row is back from L2 by then).

A checkpoint calibrated with static activation scales gives one scale for all rows instead.

The Triton interpreter rounds to float8 wrongly, so on CPU the kernel is tested with a float16
or float32 `out_dtype` (which checks the max, the scale and the clamp); float8 itself is tested
on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import check_float, check_same_device, pdl_launch, pdl_wait

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1e-12 / FP8_MAX  # an all-zero row gets this scale (and zeros), never 0 / 0
_OUT_DTYPES = (FP8_DTYPE, torch.float16, torch.float32)
INT8_MAX = 127.0
INT8_MIN_SCALE = 1e-12  # (models/int8.py's)
# 1.5 * 2^23: adding it to a float32 of magnitude under 2^22 leaves no fraction bits, so the
# addition rounds to an integer (ties to even) and subtracting it gives that integer exactly
_ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def row_scale(amax, q_max, min_scale):
    """A row's dynamic scale from its max |x| (float32): amax / q_max, at least min_scale."""
    return tl.maximum(tl.math.div_rn(amax, q_max), min_scale)


@triton.jit
def quantize(x, scale, q_max, ROUND: tl.constexpr):
    """float32 x / scale saturated to [-q_max, q_max] (and, with ROUND, to the nearest integer,
    ties to even as torch.round: |q| < 2^22), still float32 for the caller's store to cast."""
    # div_rn: IEEE division as torch's (the `/` operator is an approximate one on the GPU)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -q_max), q_max)
    if ROUND:
        q = (q + _ROUNDER) - _ROUNDER
    return q


@triton.jit
def store_quantized_row(
    q_ptrs, scale_ptr, x, mask, static_scale_ptr, q_max, min_scale,
    STATIC: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """A whole row held in registers (float32 x [BLOCK], 0 where masked off) quantised as
    _per_token_quant_kernel quantises it: its scale to scale_ptr, its values to q_ptrs."""
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        scale = row_scale(tl.max(tl.abs(x), 0), q_max, min_scale)
    tl.store(scale_ptr, scale)
    tl.store(q_ptrs, quantize(x, scale, q_max, ROUND).to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _per_token_quant_kernel(
    q_ptr, scale_ptr, x_ptr, static_scale_ptr, stride_x, cols, q_max, min_scale,
    STATIC: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:  # the checkpoint's calibrated scale, the same for every row
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            mask = start + offs < cols
            x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = row_scale(tl.max(amax, 0), q_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        mask = start + offs < cols
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = quantize(x, scale, q_max, ROUND)
        tl.store(q_ptr + row * cols + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def per_token_quant_fp8(
    x: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] in out_dtype, scale [T, 1] float32) with x ~= q * scale. With
    static_scale (one float32 element) every row takes that scale instead of its own.
    out_dtype other than float8_e4m3fn is for tests under the interpreter."""
    _check_rows(x)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    check_static_scale(static_scale)
    return _quantize_rows(x, out_dtype, static_scale)


def per_token_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int8 [T, K], scale [T, 1] float32), each row symmetric with scale
    max(|x[t]|) / 127 and q rounded to nearest, ties to even: models/int8.py's quantize_rows
    in one kernel (one program per row)."""
    _check_rows(x)
    return _quantize_rows(x, torch.int8, None)


def row_quant_params(out_dtype: torch.dtype) -> tuple[float, float, bool]:
    """(q_max, min_scale, rounds to integers) of the per-token scheme that writes out_dtype:
    INT8's for int8, else FP8's (float16 / float32: FP8's unrounded, for the interpreter)."""
    if out_dtype == torch.int8:
        return INT8_MAX, INT8_MIN_SCALE, True
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be int8 or one of {_OUT_DTYPES}, got {out_dtype}")
    return FP8_MAX, MIN_SCALE, False


def check_static_scale(static_scale: torch.Tensor | None) -> None:
    if static_scale is not None and (static_scale.numel() != 1 or static_scale.dtype != torch.float32):
        raise ValueError(
            f"static_scale must be one float32 element, got {static_scale.dtype} {list(static_scale.shape)}"
        )


def _check_rows(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, features] (2-D), got shape {list(x.shape)}")
    check_float("x", x)


def _quantize_rows(
    x: torch.Tensor, out_dtype: torch.dtype, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch, one program per row, for checked arguments."""
    q_max, min_scale, round_to_integers = row_quant_params(out_dtype)
    check_same_device(x=x, **({} if static_scale is None else {"static_scale": static_scale}))
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and cols:
        block = min(4096, triton.next_power_of_2(cols))
        _per_token_quant_kernel[(rows,)](
            q, scale, x, scale if static_scale is None else static_scale,
            x.stride(0), cols, q_max, min_scale,
            STATIC=static_scale is not None, ROUND=round_to_integers, BLOCK=block,
            num_warps=min(8, max(1, block // 256)), **pdl_launch(x.device),
        )  # fmt: skip
    return q, scale


def per_token_quant_ref(
    x: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (and the CPU path of the FP8 linear layers); out_dtype int8 is
    INT8's scheme (per_token_quant_int8's: absmax / 127, rounded half to even)."""
    q_max, min_scale, round_to_integers = row_quant_params(out_dtype)
    xf = x.float()
    if static_scale is None:
        # divided by a tensor on x's device: IEEE division everywhere (as the kernel's div_rn);
        # a Python number would be a multiplication by its reciprocal on CUDA
        q_max_t = torch.full((1, 1), q_max, device=xf.device)
        scale = (xf.abs().amax(-1, keepdim=True) / q_max_t).clamp(min=min_scale)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    q = (xf / scale).clamp(-q_max, q_max)
    return (torch.round(q) if round_to_integers else q).to(out_dtype), scale


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], float32 scale [N]), one scale per output row
    (the same rounding as per_token_quant_ref, per row of the weight)."""
    q, scale = per_token_quant_ref(weight)
    return q, scale.view(-1)
