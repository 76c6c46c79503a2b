"""Residual-add fused with LayerNorm (with weight and bias): one read of x and residual, one
write, where torch runs an add and a layer norm (two reads and writes more of the row).

Rounding follows transformers' BERT: the residual sum is rounded to the input dtype before
it is normalised (`LayerNorm(hidden_states + input_tensor)` in that dtype); the statistics
and the affine step are fp32, rounded once at the end, as torch's layer_norm does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import check_float, check_same_device, check_shape

MAX_HIDDEN = 65536  # one program holds a whole row


@triton.jit
def _add_layer_norm_kernel(
    out_ptr, x_ptr, residual_ptr, weight_ptr, bias_ptr,
    stride_x, stride_r, hidden, eps,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
    summed = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
    mean = tl.sum(summed, 0) / hidden
    centred = tl.where(mask, summed - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = centred * rstd * w + b
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """layer_norm(x + residual) with weight and bias over the last dim, in x's dtype;
    x, residual [..., hidden] of one dtype; weight, bias [hidden]. Inputs are left as is."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., hidden] with hidden > 0, got shape {list(x.shape)}")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is above the supported {MAX_HIDDEN}")
    check_shape("residual", residual, tuple(x.shape))
    check_shape("weight", weight, (hidden,))
    check_shape("bias", bias, (hidden,))
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        check_float(name, t)
    if residual.dtype != x.dtype:
        raise ValueError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    check_same_device(x=x, residual=residual, weight=weight, bias=bias)
    x2, r2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    weight, bias = weight.contiguous(), bias.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _add_layer_norm_kernel[(x2.shape[0],)](
            out, x2, r2, weight, bias, x2.stride(0), r2.stride(0), hidden, eps,
            BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return out


def add_layer_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """The torch reference: the sum in x's dtype, then torch's layer_norm."""
    summed = x + residual
    return torch.nn.functional.layer_norm(summed, (x.shape[-1],), weight, bias, eps)
