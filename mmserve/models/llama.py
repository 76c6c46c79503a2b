"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one decoder with config switches.

Parameter names follow transformers' checkpoints except two merged projections:
self_attn.qkv_proj (q_proj, k_proj, v_proj stacked on rows) and mlp.gate_up_proj (gate_proj,
up_proj), so each layer runs two GEMMs fewer; load_weights() writes each HF tensor into its rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from mmserve.attention import AttentionBackend, AttentionMetadata
from mmserve.errors import UnsupportedModel
from mmserve.models.base import ModelBase, ModelCapabilities
from mmserve.models.fp8 import load_scale
from mmserve.models.gguf_linear import GgufEmbedding, GgufLinear
from mmserve.models.layers import (
    RMSNorm,
    Rope,
    RotaryEmbedding,
    load_into,
    silu_and_mul,
    silu_and_mul_quant,
)
from mmserve.models.parallel import (
    KVHeads,
    Shard,
    TensorParallel,
    columns,
    current,
    divide,
    first_rank_only,
    gather_logits,
    reduce,
    rows,
    vocab_embedding,
    vocab_per_rank,
    vocab_rows,
)
from mmserve.models.quantized_input import InputQuant, QuantizedActivation, fused_input_quant

_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# HF projection name -> (merged parameter's module name, index of its row block).
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FP8_SCALES = ("weight_scale", "input_scale")  # an FP8 checkpoint's, beside each weight
_MERGED_PARTS = Counter(merged for merged, _ in _MERGED.values())  # qkv_proj: 3, gate_up_proj: 2
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")
# names of a bare decoder's checkpoint (LlamaModel, Qwen3Model... saved alone, as embedding
# models ship: e5-mistral-7b-instruct, Qwen3-Embedding), which lack the "model." prefix
_BACKBONE_PARTS = ("embed_tokens.", "layers.", "norm.")


@dataclass(frozen=True)
class LlamaSpec:
    """Everything the decoder needs, read once from the HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 per attention_bias
    o_bias: bool  # Llama/Qwen3 per attention_bias; never Qwen2
    mlp_bias: bool  # Llama's mlp_bias
    qk_norm: bool  # Qwen3: RMSNorm over each q and k head before rotary
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention


def layer_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer window, as transformers applies it: per config.layer_types where the config
    has them (Qwen2/Qwen3, already derived from use_sliding_window/max_window_layers),
    else config.sliding_window on every layer (Mistral; Llama has none)."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return (window,) * num_layers
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedModel(f"layer_types {sorted(unknown)} are not supported")
    if "sliding_attention" in layer_types and window is None:
        raise UnsupportedModel("sliding_attention layers without a sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def llama_spec(hf_config: Any) -> LlamaSpec:
    """Reads the switches; raises UnsupportedModel for what this decoder cannot do exactly."""
    model_type = hf_config.model_type
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModel(f"model_type {model_type!r}; llama.py supports {_MODEL_TYPES}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {hf_config.hidden_act!r}; only silu is supported")
    num_heads = hf_config.num_attention_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return LlamaSpec(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        sliding_windows=layer_sliding_windows(hf_config),
    )


class Attention(nn.Module):
    def __init__(self, spec: LlamaSpec, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.tp = tp = current()
        size = 1 if tp is None else tp.size
        self.num_heads = divide(spec.num_heads, size, "the number of attention heads")
        self.num_kv_heads = (
            spec.num_kv_heads if tp is None else KVHeads.of(spec.num_kv_heads, tp).count
        )
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * spec.head_dim  # this rank's heads
        self.kv_size = self.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.scale = spec.head_dim**-0.5
        self.sliding_window = spec.sliding_windows[layer]
        # an FP8 KV cache's per-tensor scales of K and V (the checkpoint's k_scale / v_scale
        # when it has them: models/loader.py)
        self.kv_scales = (1.0, 1.0)
        self.backend = backend

    def merged_rows(self, index: int) -> slice:
        """Rows of q (0), k (1) or v (2) inside qkv_proj."""
        starts = (0, self.q_size, self.q_size + self.kv_size, self.q_size + 2 * self.kv_size)
        return slice(starts[index], starts[index + 1])

    def forward(
        self,
        x: torch.Tensor | QuantizedActivation,  # [T, hidden]
        rope: Rope,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        fused = self.backend.supports_forward_cached and rope.positions is not None
        if fused and kv_cache is not None:
            # the Triton path: rotary and the cache write in one kernel, then attention
            q = rope.apply_and_cache(q, k, v, kv_cache, meta.slot_mapping, self.kv_scales)
            out = self.backend.forward_cached(
                q, kv_cache, meta, self.scale, self.sliding_window, self.kv_scales
            )
        else:
            q, k = rope.apply(q, k)
            out = self.backend.forward(
                q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.kv_scales
            )
        return reduce(self.tp, self.o_proj(out.reshape(num_tokens, self.q_size)))


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.tp = tp = current()
        size = spec.intermediate_size
        if tp is not None:
            size = divide(size, tp.size, "intermediate_size")
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * size, spec.mlp_bias)
        self.down_proj = nn.Linear(size, spec.hidden_size, spec.mlp_bias)
        self.act_quant: InputQuant | None = None  # down_proj's, when it takes it quantised

    def merged_rows(self, index: int) -> slice:
        """Rows of gate (0) or up (1) inside gate_up_proj."""
        size = self.down_proj.in_features
        return slice(index * size, (index + 1) * size)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        quant = self.act_quant
        h = silu_and_mul(gate_up) if quant is None else silu_and_mul_quant(gate_up, quant)
        return reduce(self.tp, self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer, backend)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output, not yet added
        residual: torch.Tensor | None,  # [T, hidden]: the running sum; None before layer 0
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the running sum before it): each residual add is
        fused into the norm that follows it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def fuse_input_quant(self) -> None:
        """The norms and the activation feeding a w8a8 projection hand it its input quantised
        (models/quantized_input.py); o_proj's input comes from attention, quantised by o_proj."""
        self.input_layernorm.output_quant = fused_input_quant(self.self_attn.qkv_proj)
        self.post_attention_layernorm.output_quant = fused_input_quant(self.mlp.gate_up_proj)
        self.mlp.act_quant = fused_input_quant(self.mlp.down_proj)


class LlamaModel(nn.Module):
    def __init__(self, spec: LlamaSpec, hf_config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, backend) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        max_positions = getattr(hf_config, "max_position_embeddings", 0) or 0
        self.rotary_emb = RotaryEmbedding(hf_config, spec.head_dim, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: used instead of input_ids'
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        rope = self.rotary_emb(positions, x.dtype)  # shared by every layer
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(ModelBase):
    """The CausalLM and Fp8Model (mmserve.models.base) for Llama, Mistral, Qwen2 and Qwen3
    checkpoints."""

    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities(
        supports_fp8=True, tensor_parallel=True
    )

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = llama_spec(hf_config)
        self.num_layers = self.spec.num_layers
        self.head_dim = self.spec.head_dim
        self.vocab_size = self.spec.vocab_size
        self.hidden_size = self.spec.hidden_size
        self.sliding_windows = self.spec.sliding_windows
        self.model = LlamaModel(self.spec, hf_config, attention_backend)  # checks the split first
        self.tp = tp = current()
        kv_heads = self.spec.num_kv_heads
        self.num_kv_heads = (
            kv_heads if tp is None else KVHeads.of(kv_heads, tp).count
        )  # this rank's
        self.lm_head = nn.Linear(
            self.spec.hidden_size, vocab_per_rank(self.spec.vocab_size), bias=False
        )
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: e.g. with image rows filled in
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.model.embed_tokens(input_ids)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def fuse_input_quant(self) -> None:
        for layer in self.model.layers:
            cast(DecoderLayer, layer).fuse_input_quant()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_logits(self.tp, self.lm_head(hidden), self.vocab_size)
        return logits.float()  # [N, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())  # a tied lm_head appears once, as the embedding
        loaded: set[str] = set()
        for name, tensor in weights:
            loaded.add(self._load_one(params, backbone_name(name), tensor))
        missing = _expected_keys(params) - loaded
        if missing:
            raise UnsupportedModel(f"checkpoint lacks weights: {sorted(missing)[:8]}")

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str:
        """Loads one HF tensor; returns the key it fills in load_weights' bookkeeping."""
        if name.endswith("rotary_emb.inv_freq"):  # recomputed, never loaded
            return name
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return name  # tied: the embedding is the head
        gguf = self._gguf_target(name)
        if gguf is not None:  # a GGUF's blocks; the layer checks its rows itself (finish())
            gguf[0].load_rows(tensor, name, gguf[1])
            return name
        module_path, proj, kind = _split_name(name)
        if proj in _MERGED:
            merged, index = _MERGED[proj]
            key = f"{module_path}.{merged}.{kind}"
            if key not in params:
                raise UnsupportedModel(f"unexpected weight {name}")
            owner = self.get_submodule(module_path)
            assert isinstance(owner, (Attention, MLP))  # only they own merged projections
            load = load_scale if kind in _FP8_SCALES else load_into
            load(params[key], tensor, name, owner.merged_rows(index))
            return f"{key}#{index}"
        if name not in params:
            raise UnsupportedModel(f"unexpected weight {name}")
        if kind in _FP8_SCALES:
            load_scale(params[name], tensor, name, None)
        else:
            load_into(params[name], tensor, name)
        return name

    def weight_shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """The part of checkpoint tensor `name` this rank holds (None: all of it)."""
        return llama_shard(self.spec, self.tp, name, shape) if self.tp is not None else None


    def _gguf_target(
        self, name: str
    ) -> tuple[GgufLinear | GgufEmbedding, slice | None] | None:
        """The GgufLinear or GgufEmbedding a weight loads into, with its rows there (None: all),
        if it is one."""
        module_name, _, kind = name.rpartition(".")
        module_path, proj = module_name.rpartition(".")[::2]
        rows = None
        if proj in _MERGED:
            merged, index = _MERGED[proj]
            owner = self.get_submodule(module_path) if _has_module(self, module_path) else None
            if not isinstance(owner, (Attention, MLP)):
                return None
            module_name, rows = f"{module_path}.{merged}", owner.merged_rows(index)
        if kind != "weight" or not _has_module(self, module_name):
            return None
        target = self.get_submodule(module_name)
        return (target, rows) if isinstance(target, (GgufLinear, GgufEmbedding)) else None


def llama_shard(
    spec: LlamaSpec, tp: TensorParallel, name: str, shape: tuple[int, ...]
) -> Shard | None:
    """Column-parallel q/k/v and gate/up (weights, biases, per-channel FP8 scales), row-parallel
    o and down (their biases on rank 0), the vocabulary split; norms and per-tensor scales whole."""
    if name.endswith(_VOCAB_PARALLEL):
        return vocab_rows(tp, spec.vocab_size)
    _, proj, kind = _split_name(name)
    if kind == "input_scale" or (kind == "weight_scale" and len(shape) and shape[0] == 1):
        return None  # one scale for the whole tensor
    if proj in _ROW_PARALLEL:
        if kind == "weight":
            return columns(tp, shape[1] // tp.size)
        return first_rank_only(tp) if kind == "bias" else None
    if proj not in _COLUMN_PARALLEL:
        return None
    if proj in ("k_proj", "v_proj"):
        heads = KVHeads.of(spec.num_kv_heads, tp)
        return Shard(0, heads.first * spec.head_dim, (heads.first + heads.count) * spec.head_dim)
    return rows(tp, shape[0] // tp.size)


def backbone_name(name: str) -> str:
    """A checkpoint name as this model calls it: a bare decoder's "layers.0.mlp.up_proj.weight"
    is "model.layers.0.mlp.up_proj.weight"."""
    return f"model.{name}" if name.startswith(_BACKBONE_PARTS) else name


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _expected_keys(params: dict[str, nn.Parameter]) -> set[str]:
    """Keys load_weights must fill: a merged parameter counts once per part ("name#i")."""
    keys: set[str] = set()
    for name in params:
        parts = _MERGED_PARTS.get(_split_name(name)[1])
        keys |= {f"{name}#{i}" for i in range(parts)} if parts else {name}
    return keys


def _split_name(name: str) -> tuple[str, str, str]:
    """Splits "model.layers.0.mlp.up_proj.weight" into ("model.layers.0.mlp", "up_proj", "weight")."""
    parts = name.rsplit(".", 2)
    if len(parts) != 3:
        return "", "", name
    return parts[0], parts[1], parts[2]
