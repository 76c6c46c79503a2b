"""The Qwen2-VL and Qwen2.5-VL vision towers in plain torch.

Input is the image processor's flat patches [N, C*T*P*P] for all images of a call, each image's
patches in merge-window order (every spatial_merge_size**2 consecutive patches form one output
token); attention never crosses an image (Qwen2-VL) or, outside fullatt_block_indexes, a
window (Qwen2.5-VL). Parameter names follow the checkpoints' `visual.*` minus that prefix.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.errors import UnsupportedModel
from mmserve.models.layers import ComputedBuffers, RMSNorm, apply_rotary


@dataclass(frozen=True)
class VisionSpec:
    """The tower's shape, read once from config.vision_config."""

    depth: int
    embed_dim: int  # width of the blocks
    num_heads: int
    mlp_dim: int
    hidden_act: str  # Qwen2-VL: quick_gelu; Qwen2.5-VL: silu (gated)
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int  # spatial_merge_size: merge_size**2 patches -> one LM token
    out_dim: int  # the LM's hidden size
    rope_theta: float
    windowed: bool  # Qwen2.5-VL: RMSNorm, gated MLP with biases, window attention
    window_size: int  # in pixels (Qwen2.5-VL)
    fullatt_blocks: tuple[int, ...]  # blocks attending over the whole image (Qwen2.5-VL)


def vision_spec(hf_config: Any) -> VisionSpec:
    vc = hf_config.vision_config
    windowed = hf_config.model_type == "qwen2_5_vl"
    embed_dim = vc.hidden_size if windowed else vc.embed_dim
    for name in ("patch_size", "temporal_patch_size"):
        if not isinstance(getattr(vc, name), int):
            raise UnsupportedModel(f"vision_config.{name} must be an int")
    return VisionSpec(
        depth=vc.depth,
        embed_dim=embed_dim,
        num_heads=vc.num_heads,
        mlp_dim=vc.intermediate_size if windowed else int(embed_dim * vc.mlp_ratio),
        hidden_act=vc.hidden_act,
        in_channels=vc.in_channels,
        patch_size=vc.patch_size,
        temporal_patch_size=vc.temporal_patch_size,
        merge_size=vc.spatial_merge_size,
        out_dim=vc.out_hidden_size if windowed else vc.hidden_size,
        rope_theta=float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
        windowed=windowed,
        window_size=vc.window_size if windowed else 0,
        fullatt_blocks=tuple(vc.fullatt_block_indexes) if windowed else (),
    )


def _activation(name: str) -> nn.Module:
    from transformers.activations import ACT2FN

    return ACT2FN[name]  # type: ignore[no-any-return]


def _norm(spec: VisionSpec, dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6) if spec.windowed else nn.LayerNorm(dim, eps=1e-6)


@dataclass(frozen=True)
class Segments:
    """Where varlen_attention's segments (images or windows) lie in the rows, as device
    tensors made on the host once per set of image grids: equal segments (one image, or
    frames of one size) are a plain batch of `count`; otherwise each segment's rows are
    gathered by index [S, L] (padded to the longest), the padding masked by valid [S, L], and
    the outputs [S * L] gathered back by rows [N] (valid's positions)."""

    count: int
    index: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    rows: torch.Tensor | None = None


def segments(cu_seqlens: list[int], rows: int, device: torch.device) -> Segments:
    """The Segments of rows [cu[i], cu[i+1])."""
    lengths = [b - a for a, b in itertools.pairwise(cu_seqlens)]
    if len(set(lengths)) == 1:
        return Segments(len(lengths))
    offsets = torch.arange(max(lengths))
    valid = offsets[None, :] < torch.tensor(lengths)[:, None]  # [S, L]
    index = torch.tensor(cu_seqlens[:-1])[:, None] + offsets[None, :]
    index = index.clamp(max=rows - 1)  # [S, L]: padding reads any row, masked in attention
    back = valid.flatten().nonzero().flatten()  # [N]: segments back in order
    return Segments(len(lengths), index.to(device), valid.to(device), back.to(device))


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: Segments, scale: float
) -> torch.Tensor:
    """Bidirectional attention within each segment of q, k, v [N, H, D] (`where`), as one
    batch: no host work, no host sync (a CUDA graph can hold it)."""
    if where.index is None:  # equal segments: a plain batch, no mask
        q, k, v = (x.view(where.count, -1, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [S, H, L, D]
        return out.transpose(1, 2).flatten(0, 1)
    assert where.valid is not None and where.rows is not None
    q, k, v = (x[where.index].transpose(1, 2) for x in (q, k, v))  # [S, H, L, D]
    mask = where.valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).flatten(0, 1)[where.rows]  # [N, H, D]


class PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        # holds the checkpoint's Conv3d weight [E, C, T, P, P]; never called as a conv
        self.proj = nn.Conv3d(spec.in_channels, spec.embed_dim, kernel, kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [N, C*T*P*P] -> [N, E]
        weight = self.proj.weight
        # a stride = kernel conv over exactly one patch is a dot product: one GEMM
        return F.linear(patches.to(weight.dtype), weight.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.scale = (spec.embed_dim // spec.num_heads) ** -0.5
        self.qkv = nn.Linear(spec.embed_dim, 3 * spec.embed_dim)
        self.proj = nn.Linear(spec.embed_dim, spec.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, where: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, H, D]
        # rotated in float32, as transformers does whatever the model dtype
        q = apply_rotary(q.float(), cos, sin).to(v.dtype)
        k = apply_rotary(k.float(), cos, sin).to(v.dtype)
        return self.proj(varlen_attention(q, k, v, where, self.scale).reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc2(act(fc1 x)); Qwen2.5-VL: down(act(gate x) * up x), all with biases."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.gated = spec.windowed
        if self.gated:
            self.gate_proj = nn.Linear(spec.embed_dim, spec.mlp_dim)
            self.up_proj = nn.Linear(spec.embed_dim, spec.mlp_dim)
            self.down_proj = nn.Linear(spec.mlp_dim, spec.embed_dim)
        else:
            self.fc1 = nn.Linear(spec.embed_dim, spec.mlp_dim)
            self.fc2 = nn.Linear(spec.mlp_dim, spec.embed_dim)
        self.act = _activation(spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = _norm(spec, spec.embed_dim)
        self.attn = VisionAttention(spec)
        self.norm2 = _norm(spec, spec.embed_dim)
        self.mlp = VisionMLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, where: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, where)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge_size**2 neighbouring patches -> one LM token: norm, concatenate, 2-layer MLP."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.merged_dim = spec.embed_dim * spec.merge_size**2
        self.ln_q = _norm(spec, spec.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, spec.out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, E] -> [N / merge**2, out]
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))  # type: ignore[no-any-return]


@dataclass(frozen=True)
class VisionPlan:
    """VisionTransformer.plan(): the rotary tables, where the attention segments lie (whole
    frames; Qwen2.5-VL's windows too), and the windows' reordering of the merge units and
    its inverse."""

    cos: torch.Tensor
    sin: torch.Tensor
    full: Segments
    window: Segments | None = None
    order: torch.Tensor | None = None
    restore: torch.Tensor | None = None


class VisionTransformer(ComputedBuffers):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)
        self.compute_buffers()

    def compute_buffers(self) -> None:
        head_dim = self.spec.embed_dim // self.spec.num_heads
        # h and w each rotate a quarter of the frequencies of a head_dim // 2 rope
        exponent = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / self.spec.rope_theta**exponent, persistent=False)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, C*T*P*P] of the images whose (t, h, w) patch grids are `grids`, in
        order -> their LM tokens [N / merge**2, out_dim], in the same order."""
        return self.run(patches, self.plan(grids))

    def plan(self, grids: list[tuple[int, int, int]]) -> VisionPlan:
        """What the tower derives from the images' grids alone, made on the host and moved to
        the tower's device: the same for every set of images of those sizes."""
        device = self.inv_freq.device
        cos, sin = self._rotary(grids)  # [N, 1, D / 2]
        rows = cos.shape[0]
        cu_full = _cumulative([h * w for t, h, w in grids for _ in range(t)])  # per frame
        if not self.spec.windowed:
            return VisionPlan(cos, sin, segments(cu_full, rows, device))
        order, cu_window = self._windows(grids)
        cos, sin = (self._by_unit(y, order) for y in (cos, sin))
        return VisionPlan(cos, sin, segments(cu_full, rows, device), segments(cu_window, rows, device),
                          order, torch.argsort(order))  # fmt: skip

    def run(self, patches: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
        """forward() with the grids' plan made: device work only (a CUDA graph can hold it)."""
        x = self.patch_embed(patches)  # [N, E]
        if plan.order is not None:
            x = self._by_unit(x, plan.order)
        for i, block in enumerate(self.blocks):
            full = plan.window is None or i in self.spec.fullatt_blocks
            x = block(x, plan.cos, plan.sin, plan.full if full else plan.window)  # type: ignore[arg-type]
        out = self.merger(x)
        return out if plan.restore is None else out[plan.restore]

    def _rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.cat([_patch_positions(g, self.spec.merge_size) for g in grids])
        freqs = positions.to(self.inv_freq.device).float()[..., None] * self.inv_freq  # [N, 2, D/4]
        freqs = freqs.flatten(1)[:, None, :]  # [N, 1, D/2]: h frequencies, then w
        return freqs.cos(), freqs.sin()

    def _by_unit(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Reorders rows of x in groups of merge_size**2 (one LM token each) by order."""
        unit = self.spec.merge_size**2
        return x.view(-1, unit, *x.shape[1:])[order].flatten(0, 1)

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the merge units of every image regrouped window by window (row-major
        windows of window_size pixels, partial at the bottom/right edges), and the cumulative
        patch counts of the windows."""
        spec = self.spec
        side = spec.window_size // spec.merge_size // spec.patch_size  # window side in units
        order: list[torch.Tensor] = []
        sizes: list[int] = []
        first = 0
        for t, h, w in grids:
            units_h, units_w = h // spec.merge_size, w // spec.merge_size
            index = torch.arange(t * units_h * units_w).view(t, units_h, units_w) + first
            for frame in index:
                for rows in frame.split(side, 0):
                    for window in rows.split(side, 1):
                        order.append(window.flatten())
                        sizes.append(window.numel() * spec.merge_size**2)
            first += t * units_h * units_w
        return torch.cat(order).to(self.inv_freq.device), _cumulative(sizes)


def _patch_positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(h, w) of every patch of one image [t*h*w, 2], in the processor's merge-window order."""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    blocks = (h // merge, merge, w // merge, merge)
    hw = [x.reshape(blocks).transpose(1, 2).flatten() for x in (rows, cols)]
    return torch.stack(hw, dim=-1).repeat(t, 1)


def _cumulative(sizes: list[int]) -> list[int]:
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out
