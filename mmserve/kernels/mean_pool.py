"""Mean pooling of several inputs' token rows with the embedding's finish (Matryoshka cut, L2
normalisation) in one kernel: an embed step's pooling was a dozen torch operations (two index
copies to the device, a zeroed sum, index_add, a division, the casts, the norm and its
division), each a launch the engine's host waited on while the GPU had finished the step
(issue 23, target 4: the host-bound Embed path).

Rounding: the sum and the mean are fp32 and are not rounded to the model's dtype before the
normalisation (the torch path, mmserve.runner.pooler.pool_tokens_batch, rounds the mean to the
hidden states' dtype first); the result is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels._common import check_float

MAX_HIDDEN = 16384  # one program holds a whole row in fp32
NORM_EPS = 1e-12  # torch.nn.functional.normalize's default eps


@triton.jit
def _mean_pool_kernel(
    out_ptr, hidden_ptr, starts_ptr, lengths_ptr,
    stride_h, dims, eps,
    NORMALIZE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg).to(tl.int64)
    length = tl.load(lengths_ptr + seg)
    cols = tl.arange(0, BLOCK)
    mask = cols < dims
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for r in range(0, length, ROWS):
        rows = r + tl.arange(0, ROWS)
        at = (start + rows.to(tl.int64))[:, None] * stride_h + cols[None, :]
        tile = tl.load(hidden_ptr + at, mask=(rows < length)[:, None] & mask[None, :], other=0.0)
        acc += tile.to(tl.float32)
    mean = tl.sum(acc, 0) / tl.maximum(length, 1).to(tl.float32)
    if NORMALIZE:
        norm = tl.sqrt(tl.sum(mean * mean, 0))
        mean = mean / tl.maximum(norm, eps)
    tl.store(out_ptr + seg.to(tl.int64) * dims + cols, mean, mask=mask)


def mean_pool(
    hidden: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    normalize: bool,
    dimensions: int | None = None,
) -> torch.Tensor:
    """hidden [T, H] (float, rows contiguous); starts, lengths [R] int32 on hidden's device:
    input i's rows are hidden[starts[i] : starts[i] + lengths[i]]. Returns [R, D] float32, D =
    dimensions or H: each input's mean over its rows, its first D values, L2-normalised when
    normalize (as torch's F.normalize: divided by max(norm, 1e-12)). An input of no rows gives
    zeros."""
    if hidden.dim() != 2 or hidden.shape[1] == 0:
        raise ValueError(f"hidden must be [tokens, hidden] with hidden > 0, got {list(hidden.shape)}")
    check_float("hidden", hidden)
    width = hidden.shape[1]
    dims = width if dimensions is None else dimensions
    if not 0 < dims <= width:
        raise ValueError(f"dimensions must be in 1..{width}, got {dims}")
    if dims > MAX_HIDDEN:
        raise ValueError(f"hidden size {dims} is above the supported {MAX_HIDDEN}")
    for name, t in (("starts", starts), ("lengths", lengths)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.device != hidden.device:
            raise ValueError(f"{name} must be int32 [R] on hidden's device")
    if starts.shape != lengths.shape:
        raise ValueError("starts and lengths must have the same length")
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    out = torch.empty((starts.shape[0], dims), dtype=torch.float32, device=hidden.device)
    if starts.shape[0]:
        block = triton.next_power_of_2(dims)
        rows = max(1, min(8, 4096 // block))  # (a tile of ROWS x BLOCK fp32 sums per program)
        _mean_pool_kernel[(starts.shape[0],)](
            out, hidden, starts, lengths, hidden.stride(0), dims, NORM_EPS,
            NORMALIZE=normalize, BLOCK=block, ROWS=rows, num_warps=min(8, max(1, rows * block // 1024)),
        )  # fmt: skip
    return out


def mean_pool_ref(
    hidden: torch.Tensor, starts: list[int], lengths: list[int], normalize: bool, dimensions: int | None = None
) -> torch.Tensor:
    """The torch reference, in fp32 throughout."""
    rows = [
        hidden[s : s + n].float().mean(0) if n else hidden.new_zeros(hidden.shape[1], dtype=torch.float32)
        for s, n in zip(starts, lengths, strict=True)
    ]
    out = torch.stack(rows)[:, :dimensions] if rows else hidden.new_zeros(0, dimensions or hidden.shape[1])
    return torch.nn.functional.normalize(out, dim=-1, eps=NORM_EPS) if normalize else out.float()
