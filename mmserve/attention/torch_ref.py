"""Reference attention over the paged KV cache in plain torch: the CPU path. Its per-request
maths (write, gather, attend) lives in mmserve.kernels.paged_ref, the Triton kernels' oracle."""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from mmserve.attention.backend import AttentionBackend, AttentionMetadata
from mmserve.kernels.paged_ref import attend, gather_context, write_kv_cache


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Request indices, longest first, cut into groups whose lengths are all more than half
    the group's longest: padding a group to its longest at most doubles its work."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if not groups or 2 * lengths[i] <= lengths[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    return groups


def attend_own_tokens(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """An encoder step: each request attends within its own new tokens. Requests of similar
    length run as one padded batch through scaled_dot_product_attention (padded keys masked
    out, padded queries dropped): the same maths as attend(), without a loop per request."""
    lengths = meta.query_lens_cpu
    if not lengths:
        return torch.empty_like(q)
    if min(lengths) == max(lengths):  # the flat batch is [R, L] already: views, no copies
        valid = torch.ones(len(lengths), lengths[0], dtype=torch.bool, device=q.device)
        q_pad, k_pad, v_pad = (x.unflatten(0, valid.shape) for x in (q, k, v))
        attended = _padded_sdpa(q_pad, k_pad, v_pad, valid, scale, meta.causal, sliding_window)
        return attended.reshape(q.shape).to(q.dtype)
    starts = list(accumulate(lengths, initial=0))
    out = torch.empty_like(q)
    for group in length_groups(lengths):
        pos = torch.arange(lengths[group[0]], device=q.device)
        group_lens = torch.tensor([lengths[i] for i in group], device=q.device)
        group_starts = torch.tensor([starts[i] for i in group], device=q.device)
        valid = pos < group_lens[:, None]  # [G, L]: which padded slots are real tokens
        rows = torch.where(valid, group_starts[:, None] + pos, 0).flatten()  # [G * L] token rows
        q_pad, k_pad, v_pad = (_rows(x, rows).unflatten(0, valid.shape) for x in (q, k, v))
        attended = _padded_sdpa(q_pad, k_pad, v_pad, valid, scale, meta.causal, sliding_window)
        keep = valid.flatten()
        attended = attended.reshape(len(rows), -1).to(q.dtype)  # [G * L, H * D]
        out.flatten(1).index_copy_(0, rows[keep], attended[keep])
    return out


def _rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] for x: [T, heads, D] (a strided view is fine); index_select on the flattened
    rows is several times faster than advanced indexing on CPU."""
    return x.flatten(1).index_select(0, rows).unflatten(1, x.shape[1:])


def _padded_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """q: [G, L, H, D]; k, v: [G, L, Hkv, D]; valid: [G, L]. Returns [G, L, H, D] in float32
    (as attend() computes); rows of padded queries are garbage, for the caller to drop."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))  # [G, heads, L, D]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    length = q.shape[2]
    pos = torch.arange(length, device=q.device)
    allowed = valid[:, None, None, :]  # [G, 1, 1, L]: keys that are real tokens
    if causal:
        allowed = allowed & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        allowed = allowed & (pos[None, :] > pos[:, None] - sliding_window)
    mask = None if bool(valid.all()) and not causal and sliding_window is None else allowed
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


class TorchAttentionBackend(AttentionBackend):
    """Decoder steps loop over requests (exact and simple, not fast); encoder steps batch
    requests of similar length through one padded attention each."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        if kv_cache is None:  # encoder: each request's own tokens are its whole context
            return attend_own_tokens(q, k, v, meta, scale, sliding_window)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, kv_scales)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            rows = slice(start, start + q_len)
            ctx_k, ctx_v = gather_context(kv_cache, meta.block_tables[i], seq_len, kv_scales)
            out[rows] = attend(q[rows], ctx_k, ctx_v, scale, meta.causal, sliding_window)
            start += q_len
        return out
