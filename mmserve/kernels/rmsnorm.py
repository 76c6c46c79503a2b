"""RMSNorm, and residual-add fused with RMSNorm (one read of x and residual, one pass); each
may also quantise its output per token for the w8a8 projection it feeds (add_rms_norm_quant).

Rounding follows HF Llama: the residual sum is rounded to the input dtype before it is
normalised, the statistics are fp32, and the normalised value is rounded to the input dtype
before it is scaled by the weight. The quantised output is that of the product rounded to the
input dtype, as mmserve/kernels/quant.py quantises the stored output: bit for bit the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import (
    check_float,
    check_same_device,
    check_shape,
    pdl_launch,
    pdl_wait,
)
from mmserve.kernels.quant import (
    check_static_scale,
    per_token_quant_ref,
    row_quant_params,
    store_quantized_row,
)

MAX_HIDDEN = 65536  # one program holds a whole row


@triton.jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, scale_ptr, static_scale_ptr,
    stride_x, stride_r, hidden, eps, q_max, min_scale,
    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, STATIC: tl.constexpr, ROUND: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """QUANT: out_ptr takes the output quantised (mmserve/kernels/quant.py's scheme: q_max, min_scale,
    STATIC, ROUND) and scale_ptr its per-row scales."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(x_ptr.dtype.element_ty)  # the unquantised output, 0 where masked off
    if QUANT:
        store_quantized_row(
            out_ptr + row * hidden + cols, scale_ptr + row, y.to(tl.float32), mask,
            static_scale_ptr, q_max, min_scale, STATIC, ROUND,
        )  # fmt: skip
    else:
        tl.store(out_ptr + row * hidden + cols, y, mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns (out, x + residual or x, scale): out the normed value in x's shape and dtype and
    scale None; or with out_dtype (int8, or FP8's out dtypes) out its per-token quantisation
    [rows, hidden] and scale the float32 [rows, 1] scales."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., hidden] with hidden > 0, got shape {list(x.shape)}")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is above the supported {MAX_HIDDEN}")
    check_shape("weight", weight, (hidden,))
    check_float("x", x)
    check_float("weight", weight)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    quant = (0.0, 0.0, False) if out_dtype is None else row_quant_params(out_dtype)
    check_static_scale(static_scale)
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_shape("residual", residual, tuple(x.shape))
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
        tensors["residual"] = residual
    if static_scale is not None:
        tensors["static_scale"] = static_scale
    check_same_device(**tensors)
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = x2 if residual is None else residual.reshape(-1, hidden)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    rows = x2.shape[0]
    if out_dtype is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        scale = None
    else:
        out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    residual_out = x2 if residual is None else torch.empty_like(x)
    if rows > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            out, residual_out, x2, r2, weight, out if scale is None else scale,
            out if static_scale is None else static_scale,
            x2.stride(0), r2.stride(0), hidden, eps, quant[0], quant[1],
            HAS_RESIDUAL=residual is not None, QUANT=out_dtype is not None,
            STATIC=static_scale is not None, ROUND=quant[2], BLOCK=block,
            num_warps=min(16, max(1, block // 512)), **pdl_launch(x.device),
        )  # fmt: skip
    return out, x if residual is None else residual_out, scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden], weight [hidden] -> x / rms(x) * weight, in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the inputs are left as they are."""
    out, summed, _ = _launch(x, residual, weight, eps)
    return out, summed


def add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out_dtype: torch.dtype, static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """fused_add_rms_norm (rms_norm without a residual) with its output quantised per token in
    one kernel: (q [rows, hidden] out_dtype, scale [rows, 1] float32, x + residual or x), q and
    scale exactly what mmserve/kernels/quant.py's per_token_quant_int8 (out_dtype int8) or
    per_token_quant_fp8 (FP8's out dtypes, static_scale) give for the unquantised output."""
    q, summed, scale = _launch(x, residual, weight, eps, out_dtype, static_scale)
    assert scale is not None
    return q, scale, summed


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch reference (HF LlamaRMSNorm)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(x.dtype).float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(summed, weight, eps), summed


def add_rms_norm_quant_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out_dtype: torch.dtype, static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The torch reference: the unfused references, one after the other."""
    if residual is None:
        out, summed = rms_norm_ref(x, weight, eps), x
    else:
        out, summed = fused_add_rms_norm_ref(x, residual, weight, eps)
    q, scale = per_token_quant_ref(out.reshape(-1, x.shape[-1]), out_dtype, static_scale)
    return q, scale, summed
