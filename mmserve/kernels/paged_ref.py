"""The paged KV cache in plain torch, one request at a time: the CPU attention backend's maths
(mmserve.attention.torch_ref) and the references the Triton kernels are tested against. It
imports no triton, so the CPU path can load it at any time.

kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V), in the model's dtype
or in FP8 (float8_e4m3fn): then each of K and V has a per-tensor scale, a value x is stored as
fp8(clamp(x / scale, -448, 448)) (round to nearest even) and read back as float(stored) * scale.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
NO_SCALES = (1.0, 1.0)


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as the cache stores it in FP8: x / scale, saturated to +-448, rounded to e4m3."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[float, float] = NO_SCALES,
) -> None:
    """Stores each token's K/V at its slot. kv_cache: [2, num_blocks, block_size, Hkv, D];
    scales: (K's, V's), for an FP8 cache."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_blocks * block_size, Hkv, D]
    if kv_cache.dtype == FP8:  # (the CPU has no index_copy_ of float8: copy the bytes)
        raw = flat.view(torch.uint8)
        raw[0].index_copy_(0, slots, to_fp8(k[keep], scales[0]).view(torch.uint8))
        raw[1].index_copy_(0, slots, to_fp8(v[keep], scales[1]).view(torch.uint8))
        return
    flat[0].index_copy_(0, slots, k[keep].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[keep].to(kv_cache.dtype))


def gather_context(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scales: tuple[float, float] = NO_SCALES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first seq_len keys and values: two [seq_len, Hkv, D] tensors (float32
    when the cache is FP8: read back with scales)."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    if kv_cache.dtype == FP8:
        raw = kv_cache.view(torch.uint8)
        k = raw[0, blocks].flatten(0, 1)[:seq_len].view(FP8).float() * scales[0]
        v = raw[1, blocks].flatten(0, 1)[:seq_len].view(FP8).float() * scales[1]
        return k, v
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v


def context_mask(
    num_q: int, seq_len: int, causal: bool, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """[Q, S] bool, True where the last Q of S positions may attend; None when all may."""
    if not causal and sliding_window is None:
        return None
    q_pos = torch.arange(seq_len - num_q, seq_len, device=device).unsqueeze(1)  # [Q, 1]
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)  # [1, S]
    allowed = torch.ones(num_q, seq_len, dtype=torch.bool, device=device)
    if causal:
        allowed &= k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """q: [Q, H, D] at the last Q of S positions; k, v: [S, Hkv, D]. Returns [Q, H, D]."""
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    allowed = context_mask(num_q, seq_len, causal, sliding_window, scores.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
