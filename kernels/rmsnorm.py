"""RMSNorm, and residual-add fused with RMSNorm (one read of x and residual, one pass).

Rounding follows HF Llama: the residual sum is rounded to the input dtype before it is
normalised, the statistics are fp32, and the normalised value is rounded to the input dtype
before it is scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import check_float, check_same_device, check_shape

MAX_HIDDEN = 65536  # one program holds a whole row


@triton.jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    stride_x, stride_r, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, residual sum); without a residual the second is the first."""
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
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_shape("residual", residual, tuple(x.shape))
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
        tensors["residual"] = residual
    check_same_device(**tensors)
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = x2 if residual is None else residual.reshape(-1, hidden)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = out if residual is None else torch.empty_like(out)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            out, residual_out, x2, r2, weight,
            x2.stride(0), r2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden], weight [hidden] -> x / rms(x) * weight, in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the inputs are left as they are."""
    return _launch(x, residual, weight, eps)


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
