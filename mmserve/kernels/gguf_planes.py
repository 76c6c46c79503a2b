"""Q6_K's blocks in planes (gguf_gemm.Q6K_ALIGNED): the same bytes, reordered so that every field
is 16-byte aligned and loads as whole vectors.

A Q6_K block is 210 bytes (ql[128], qh[64], scales[16] int8, d float16), so in the file's
layout a row's blocks are only 2-byte aligned, and its int8-activation product (dp4a) put its
32-bit words together from 16-bit loads: slower than the 16-bit dequantisation (session 23).
In planes, each row of the weight keeps its bytes, grouped by field across the row's num_blocks
blocks:

    row r: ql [num_blocks, 128] | qh [num_blocks, 64] | scales [num_blocks, 16] | d [num_blocks, 2] | pad

a uint8 tensor [N, plane_row_bytes(num_blocks)] (2-D, where the file's blocks are [N, num_blocks,
210]: the layouts cannot be mistaken for each other). The row is padded to a multiple of 16
bytes: no byte when num_blocks is a multiple of 8 (K a multiple of 2048: every Llama
projection and LM head), else at most 14 a row. No other byte is added, and planes are row
slices like blocks are (a chunk of rows is a contiguous slice). The reordering is exact and
reversible (q6k_blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Q6K_BYTES = 210  # ggml's block_q6_K
Q6K_FIELDS = ((0, 128), (128, 192), (192, 208), (208, 210))  # ql, qh, scales, d: [start, stop) in a block


def plane_row_bytes(num_blocks: int) -> int:
    """Bytes of a row of num_blocks Q6_K blocks in planes: 210 each, padded to a multiple of 16."""
    return -(-num_blocks * Q6K_BYTES // 16) * 16


def is_planes(blocks: torch.Tensor) -> bool:
    """Whether a Q6_K weight is in planes (2-D) rather than the file's blocks (3-D)."""
    return blocks.dim() == 2


def planes_blocks(planes: torch.Tensor) -> int:
    """The blocks a row of planes holds (its padding is under 16 bytes: less than a block)."""
    return planes.shape[1] // Q6K_BYTES


def check_planes(name: str, planes: torch.Tensor) -> int:
    """planes is uint8 [N, plane_row_bytes(num_blocks)], contiguous; returns num_blocks."""
    num_blocks = planes_blocks(planes) if planes.dim() == 2 else 0
    if planes.dtype != torch.uint8 or planes.dim() != 2 or planes.shape[1] != plane_row_bytes(num_blocks):
        raise ValueError(
            f"{name} must be Q6_K planes, uint8 [N, 210 * blocks per row padded to 16], got "
            f"{planes.dtype} {list(planes.shape)}"
        )
    if not planes.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {planes.stride()}")
    return num_blocks


def _fields(planes: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Views of planes' fields, each [N, num_blocks, field bytes]."""
    n, at, views = planes.shape[0], 0, []
    for start, stop in Q6K_FIELDS:
        width = (stop - start) * num_blocks
        views.append(planes[:, at : at + width].view(n, num_blocks, stop - start))
        at += width
    return views


def q6k_planes(blocks: torch.Tensor) -> torch.Tensor:
    """The file's Q6_K blocks uint8 [N, num_blocks, 210] -> planes [N, plane_row_bytes(num_blocks)],
    field by field (no temporary: each copy goes straight into its plane)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != Q6K_BYTES:
        raise ValueError(f"blocks must be Q6_K blocks, uint8 [N, blocks, 210], got {blocks.dtype} {list(blocks.shape)}")
    n, num_blocks = blocks.shape[0], blocks.shape[1]
    planes = torch.zeros(n, plane_row_bytes(num_blocks), dtype=torch.uint8, device=blocks.device)
    for view, (start, stop) in zip(_fields(planes, num_blocks), Q6K_FIELDS, strict=True):
        view.copy_(blocks[:, :, start:stop])
    return planes


def q6k_blocks(planes: torch.Tensor) -> torch.Tensor:
    """planes -> the file's blocks uint8 [N, num_blocks, 210] (q6k_planes' inverse)."""
    num_blocks = check_planes("planes", planes)
    blocks = torch.empty(planes.shape[0], num_blocks, Q6K_BYTES, dtype=torch.uint8, device=planes.device)
    for view, (start, stop) in zip(_fields(planes, num_blocks), Q6K_FIELDS, strict=True):
        blocks[:, :, start:stop] = view
    return blocks


@triton.jit
def q6k_fields(row, step, num_blocks, PLANES: tl.constexpr):
    """Where block `step` of the Q6_K rows at byte pointers row [BLOCK_N] lies: byte pointers
    base [BLOCK_N] and the byte offsets from them (the same for every row) of its ql, qh, scales
    and d. PLANES: in planes (16-byte aligned: ql, qh and the scales load as vectors), else the
    file's 210-byte blocks (num_blocks unused; the offsets constants, as loads' immediates)."""
    if PLANES:
        return row, step * 128, num_blocks * 128 + step * 64, num_blocks * 192 + step * 16, num_blocks * 208 + step * 2
    else:
        return row + step * 210, 0, 128, 192, 208
