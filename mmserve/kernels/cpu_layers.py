"""A decoder layer's small float32 operations by the CPU's C library (mmserve.kernels.cpu_lib;
mmserve/kernels/cpu/layer_ops.c): the residual add with RMSNorm, rotary embedding, the KV
cache write and SiLU-and-mul, each one call where torch runs several small operations; and a
grammar's bitmask applied to the logits. A decode step of SmolLM2-135M at batch 16 spent
8.3-8.7 ms outside its products and attention before them (measured with both stubbed out),
5.5 ms after.

Each computes what the torch path (mmserve.models.layers, mmserve.kernels.paged_ref) computes,
with the same roundings: rotary and the cache write bit-equal, RMSNorm but for the order of
its sum of squares, SiLU within a few ulp (its exp is the library's polynomial). supports()
says where they apply (float32 CPU tensors, the library built); elsewhere the callers keep
their torch paths.
"""

from __future__ import annotations

import ctypes

import torch

from mmserve.kernels.cpu_lib import library, require


def supports(*tensors: torch.Tensor) -> bool:
    """All float32 CPU tensors, the library here."""
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors) and library() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with unit stride inside a row (rows may be apart), copied if not."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * s / sqrt(mean(s^2) + eps), s) with s = x + residual (x without one): what
    RMSNorm computes in float32, in one call. x, residual [..., dim]; weight [dim], contiguous
    (a parameter)."""
    x2, weight = _rows(x), weight if weight.is_contiguous() else weight.contiguous()
    res = _rows(residual) if residual is not None else None
    out = x2.new_empty(x2.shape)
    total = out.new_empty(x2.shape) if res is not None else x
    require().rms_norm_f32(
        torch.get_num_threads(), x2.data_ptr(), x2.stride(0),
        None if res is None else res.data_ptr(), 0 if res is None else res.stride(0),
        weight.data_ptr(), x2.shape[0], x2.shape[1], eps, out.data_ptr(),
        None if res is None else total.data_ptr(),
    )  # fmt: skip
    if x.dim() != 2:
        out = out.view(x.shape)
        total = total if res is None else total.view(x.shape)
    return out, total


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated neox style by cos, sin [T, 1, D // 2] (or [T, D // 2]): a new
    contiguous tensor, bit-equal to mmserve.models.layers.apply_rotary."""
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:  # (heads back to back within a token's row)
        x = x.contiguous()
    cos, sin = cos.reshape(tokens, dim // 2).contiguous(), sin.reshape(tokens, dim // 2).contiguous()
    out = torch.empty(tokens, heads, dim, dtype=torch.float32)
    require().rotary_f32(torch.get_num_threads(), x.data_ptr(), x.stride(0), tokens, heads, dim,
                         cos.data_ptr(), sin.data_ptr(), out.data_ptr())  # fmt: skip
    return out


def write_kv_cpu(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] (contiguous) at
    slot_mapping [T] (int64; -1 skips the token), as paged_ref.write_kv_cache stores them."""
    width = kv_cache.shape[3] * kv_cache.shape[4]
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    k2, v2 = _rows(k.reshape(k.shape[0], width)), _rows(v.reshape(v.shape[0], width))
    slots = slot_mapping.to(torch.int64).contiguous()
    status = require().write_kv_f32(k2.data_ptr(), k2.stride(0), v2.data_ptr(), v2.stride(0), k2.shape[0],
                                    width, slots.data_ptr(), num_slots, kv_cache.data_ptr())  # fmt: skip
    if status:
        raise ValueError(f"slot_mapping holds a slot past the cache's {num_slots}")


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate then up) -> [..., I] = silu(gate) * up, in one call; exp is the
    library's polynomial, so within a few float32 ulp of torch's silu, not bit-equal."""
    rows = _rows(gate_up)
    width = rows.shape[1] // 2
    out = rows.new_empty((rows.shape[0], width))
    require().silu_and_mul_f32(torch.get_num_threads(), rows.data_ptr(), rows.stride(0), rows.shape[0], width,
                               out.data_ptr())  # fmt: skip
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], width)


def apply_bitmask_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, indices: list[int], lib: ctypes.CDLL | None = None
) -> None:
    """logits [B, V] float32 (unit stride in a row) set to -inf in place at the rows indices'
    tokens below vocab_size whose bits are clear in bitmask [B, W] int32 (CPU): what
    mmserve.structured_output.backend's torch code does, in one call (its apply_bitmask's
    kernel for float32 CPU logits)."""
    bits = bitmask if bitmask.stride(-1) == 1 else bitmask.contiguous()
    index = torch.tensor(indices, dtype=torch.int64)
    require(lib).apply_bitmask_f32(torch.get_num_threads(), logits.data_ptr(), logits.stride(0), bits.data_ptr(),
                                bits.stride(0), index.data_ptr(), len(indices), vocab_size)  # fmt: skip
