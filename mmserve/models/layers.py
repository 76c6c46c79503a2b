"""Building blocks shared by the model implementations, in plain torch.

Each block computes exactly what its transformers counterpart computes (same dtype casts, same
order of operations), so that our logits match transformers' within float tolerance.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.errors import UnsupportedModel

# Rope types whose frequencies depend on the batch's longest sequence: transformers recomputes
# them per forward, which a server batching unrelated requests cannot reproduce.
_SEQ_LEN_DEPENDENT_ROPE = ("dynamic", "longrope")


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), normalised in float32 and cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate then up) -> [..., I] = silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_parameters(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scale, as transformers
    computes them (transformers 5 keeps rope_theta and any scaling in config.rope_parameters)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if "rope_theta" not in params:
        raise UnsupportedModel(f"rope_parameters {params} has no rope_theta")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModel("partial_rotary_factor < 1 is not supported")
    if rope_type in _SEQ_LEN_DEPENDENT_ROPE:
        raise UnsupportedModel(f"rope_type {rope_type!r} depends on the batch's sequence length")
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        valid = sorted(set(ROPE_INIT_FUNCTIONS) - set(_SEQ_LEN_DEPENDENT_ROPE) | {"default"})
        raise UnsupportedModel(f"rope_type {rope_type!r} is not supported; supported: {valid}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate the two halves of each head)."""

    def __init__(self, inv_freq: torch.Tensor, scale: float) -> None:
        super().__init__()
        # [head_dim // 2] float32 whatever the model dtype
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scale = scale  # yarn-style attention factor folded into cos and sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [T] -> cos, sin, each [T, 1, head_dim // 2] in dtype (1 broadcasts heads)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.scale).to(dtype)
        sin = (freqs.sin() * self.scale).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos, sin [T, 1, D // 2]; same ops as transformers'
    x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def load_into(
    param: torch.Tensor, tensor: torch.Tensor, name: str, rows: slice | None = None
) -> None:
    """Copies a checkpoint tensor into param (or into a row range of a merged param), casting
    dtype and device; a shape mismatch names the weight."""
    target = param.data if rows is None else param.data[rows]
    if target.shape != tensor.shape:
        raise UnsupportedModel(
            f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}"
        )
    target.copy_(tensor)
