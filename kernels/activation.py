"""SiLU-and-multiply for the fused gate_up projection: [..., 2I] -> silu(gate) * up, [..., I].

The gate is the first half of the last dimension and up the second (vLLM's layout).
Arithmetic is fp32, rounded once to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mmserve.kernels._common import check_float, check_same_device


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> [..., I] = silu(x[..., :I]) * x[..., I:]."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * intermediate], got shape {list(x.shape)}")
    check_float("x", x)
    check_same_device(x=x)
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            out, x2, x2.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
