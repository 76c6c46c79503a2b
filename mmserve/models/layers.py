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
from mmserve.kernels import cpu_layers
from mmserve.models.quantized_input import InputQuant, QuantizedActivation

# Rope types whose frequencies depend on the batch's longest sequence: transformers recomputes
# them per forward, which a server batching unrelated requests cannot reproduce.
_SEQ_LEN_DEPENDENT_ROPE = ("dynamic", "longrope")


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), normalised in float32 and cast back before the weight.

    With a residual, first x = x + residual (in x's dtype, as transformers adds it), and the
    sum is returned too. On CUDA both run as one Triton kernel (mmserve.kernels.rmsnorm), on the
    CPU in float32 as one call of the C library (mmserve.kernels.cpu_layers) where it built.
    With output_quant set (the norm feeds a w8a8 projection: models/quantized_input.py), y is
    handed over quantised as that projection quantises its input, by the same kernel."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.output_quant: InputQuant | None = None  # set after the projections are swapped

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        quant = self.output_quant
        if quant is not None and quant.uses_kernels(x) and x.is_contiguous():
            from mmserve.kernels.rmsnorm import add_rms_norm_quant

            q, scale, x = add_rms_norm_quant(
                x, residual, self.weight, self.eps, quant.dtype, quant.static_scale
            )
            out: torch.Tensor | QuantizedActivation = QuantizedActivation(q, scale, x.dtype, x.shape)
        else:
            normed, x = self._unfused(x, residual)
            out = normed if quant is None else quant.quantize(normed)
        return out if residual is None else (out, x)

    def _unfused(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed value, x + residual or x)."""
        if x.is_cuda and x.is_contiguous():
            from mmserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps), x
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if cpu_layers.supports(x, self.weight, *(() if residual is None else (residual,))):
            return cpu_layers.rms_norm_cpu(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def add_layer_norm(norm: nn.LayerNorm, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """norm(x + residual), the sum rounded to x's dtype first (as transformers adds it); one
    Triton kernel on CUDA (mmserve.kernels.layernorm) instead of an add and a layer norm."""
    if x.is_cuda and norm.weight is not None and norm.bias is not None:
        from mmserve.kernels.layernorm import add_layer_norm as fused

        return fused(x, residual, norm.weight, norm.bias, norm.eps)
    return norm(x + residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate then up) -> [..., I] = silu(gate) * up (one Triton kernel on CUDA, one
    call of the C library in float32 on the CPU where it built)."""
    if gate_up.is_cuda:
        from mmserve.kernels.activation import silu_and_mul as fused

        return fused(gate_up)
    if cpu_layers.supports(gate_up):
        return cpu_layers.silu_and_mul_cpu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_quant(gate_up: torch.Tensor, quant: InputQuant) -> QuantizedActivation:
    """silu_and_mul(gate_up) quantised as quant's projection quantises its input: in the same
    kernel where quant uses kernels."""
    if not quant.uses_kernels(gate_up):
        return quant.quantize(silu_and_mul(gate_up))
    from mmserve.kernels.activation import silu_and_mul_quant as fused

    q, scale = fused(gate_up, quant.dtype, quant.static_scale)
    shape = torch.Size((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
    return QuantizedActivation(q, scale, gate_up.dtype, shape)


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
    with torch.device("cpu"):  # (a model built on the meta device computes these again later)
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


class Rope:
    """What one forward needs to rotate q and k: per-token cos/sin on the torch path, or the
    cos/sin tables and the positions for the Triton kernel on CUDA."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None) -> None:
        self.cos = cos  # torch path: [T, 1, D/2] in the model dtype; CUDA: [max_pos, D/2] fp32
        self.sin = sin
        self.positions = positions  # [T], CUDA only

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.positions is not None:
            from mmserve.kernels.rotary import rotary_embedding

            return rotary_embedding(self.positions, q, k, self.cos, self.sin)
        if cpu_layers.supports(q, k, self.cos):  # (one C call each)
            return cpu_layers.rotary_cpu(q, self.cos, self.sin), cpu_layers.rotary_cpu(k, self.cos, self.sin)
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)

    def apply_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """CUDA only (positions set): q rotated; k rotated and v written into kv_cache at
        slot_mapping, all in one launch (kv_scales: an FP8 cache's)."""
        from mmserve.kernels.rotary import rotary_embedding_and_cache

        assert self.positions is not None
        return rotary_embedding_and_cache(
            self.positions, q, k, v, self.cos, self.sin, kv_cache, slot_mapping, kv_scales
        )


class ComputedBuffers(nn.Module):
    """A module whose buffers are computed from its settings, never loaded from a checkpoint.
    compute_buffers() (re)makes them on the default device; __init__ calls it, and a model
    built on the meta device (whose buffers hold no values) calls it again once its
    parameters have storage (models/loader.py)."""

    def compute_buffers(self) -> None:
        raise NotImplementedError


class RotaryEmbedding(ComputedBuffers):
    """Neox-style rotary embedding (rotate the two halves of each head), with the
    frequencies rope_parameters(hf_config, head_dim) gives."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int = 0) -> None:
        super().__init__()
        self.rope_config, self.head_dim = hf_config, head_dim
        self.max_positions = max_positions  # rows of the CUDA tables
        self.compute_buffers()

    def compute_buffers(self) -> None:
        inv_freq, scale = rope_parameters(self.rope_config, self.head_dim)
        # [head_dim // 2] float32 whatever the model dtype
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scale = scale  # yarn-style attention factor folded into cos and sin
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        if positions.is_cuda and self.max_positions:
            return Rope(*self._cuda_tables(), positions)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.scale).to(dtype)
        sin = (freqs.sin() * self.scale).to(dtype)
        return Rope(cos.unsqueeze(1), sin.unsqueeze(1), None)  # [T, 1, D/2]: 1 broadcasts heads

    def _cuda_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [max_positions, D/2] tables, built once (before any CUDA graph capture)."""
        if self._tables is None:
            pos = torch.arange(self.max_positions, device=self.inv_freq.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]
            self._tables = (freqs.cos() * self.scale, freqs.sin() * self.scale)
        return self._tables


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


class FewRowsLinear(nn.Linear):
    """An nn.Linear whose products of a few rows (up to dense_gemv.ENGINE_ROWS) of 16-bit
    activations on CUDA (or under the Triton interpreter: tests) run on dense_gemv (issue 23,
    target 1); every other input takes F.linear. few_rows_products swaps a loaded model's plain
    projections to it in place (their parameters, tied or not, unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from mmserve.kernels import dense_gemv as gemv
        from mmserve.kernels._common import triton_runs_on

        w = self.weight
        few = x.dim() == 2 and 1 <= x.shape[0] <= gemv.ENGINE_ROWS and x.stride(-1) == 1
        if few and x.dtype == w.dtype and x.dtype in _SIXTEEN_BITS and triton_runs_on(x.device):
            return gemv.dense_gemv(x, w, self.bias)  # (one row with x.stride(-1) == 1 is contiguous)
        return F.linear(x, w, self.bias)


_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def few_rows_products(model: nn.Module) -> int:
    """Swaps every plain nn.Linear of model whose weight is 16-bit with contiguous rows to
    FewRowsLinear; returns how many. (The loader calls it for models on CUDA.)"""
    swapped = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if type(module) is nn.Linear and w is not None and w.dtype in _SIXTEEN_BITS and w.stride(1) == 1:
            module.__class__ = FewRowsLinear
            swapped += 1
    return swapped
