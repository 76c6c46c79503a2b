"""Transformer pieces shared by CLIP and SigLIP: the pre-norm encoder layer of both their
towers, the tower and dual-encoder frames around it, the text transformer of both dual
encoders, and weight loading by HF name.

Module and parameter names are transformers' own (encoder.layers.0.self_attn.q_proj, ...), so
a checkpoint name maps onto a parameter by stripping a prefix. Attention is
scaled_dot_product_attention over [B, heads, N, D]: images are whole (bidirectional), and
texts of a flat batch are padded into [B, L] with a mask that keeps each inside itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.attention import AttentionMetadata
from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.models.base import ModelBase, ModelCapabilities
from mmserve.models.layers import load_into


@dataclass(frozen=True)
class EncoderSpec:
    """One CLIP/SigLIP transformer (vision or text), read from its sub-config."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str


def encoder_spec(config: Any) -> EncoderSpec:
    if config.hidden_size % config.num_attention_heads:
        raise UnsupportedModel("hidden_size is not a multiple of num_attention_heads")
    return EncoderSpec(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        layer_norm_eps=config.layer_norm_eps,
        hidden_act=config.hidden_act,
    )


class Attention(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.num_heads, self.head_dim = spec.num_heads, hidden // spec.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(
        self,
        x: torch.Tensor,  # [B, N, hidden]
        mask: torch.Tensor | None,  # [B, 1, N, N] bool, True = may attend; None = all
    ) -> torch.Tensor:
        batch, num_tokens, hidden = x.shape
        q, k, v = (
            proj(x).view(batch, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )  # each [B, heads, N, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, num_tokens, hidden))


class MLP(nn.Module):
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.act = ACT2FN[spec.hidden_act]
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """Pre-norm layer: x = x + attn(LN(x)); x = x + mlp(LN(x))."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = Attention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    """The first num_layers layers of a tower (those after the one read need not exist)."""

    def __init__(self, spec: EncoderSpec, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(spec) for _ in range(num_layers))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, keep: frozenset[int] = frozenset()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(last output, {i: hidden state i for i in keep}), where state 0 is the input and
        state i the output of layer i (transformers' output_hidden_states numbering)."""
        kept = {0: x} if 0 in keep else {}
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x, mask)
            if i in keep:
                kept[i] = x
        return x, kept


def hidden_state_index(index: int, num_layers: int) -> int:
    """A hidden_states index as transformers takes it (negative from the end of the
    num_layers + 1 states) -> its non-negative form; out of range raises."""
    resolved = index + num_layers + 1 if index < 0 else index
    if not 0 <= resolved <= num_layers:
        raise UnsupportedModel(f"hidden state {index} of a {num_layers}-layer tower")
    return resolved


def check_image_size(pixel_values: torch.Tensor, image_size: int) -> None:
    """Towers take images at their trained size (the image processor resizes to it)."""
    if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, image_size, image_size):
        raise InvalidArgument(
            "pixel_values",
            f"shape {tuple(pixel_values.shape)}; the tower takes [B, 3, {image_size}, {image_size}]",
        )


class VisionTower(nn.Module):
    """A CLIP/SigLIP vision model, built up to the deepest hidden state its owner reads.

    num_layers: encoder layers to build (default all); with_pool: also the parts of the pooled
    output (LLaVA reads hidden states only). Subclasses add their embeddings (embed()), the
    pooled output (pooled()) and name the pooling parts' checkpoint prefixes."""

    has_class_token: ClassVar[bool]  # one row per image besides the patches
    pool_parts: ClassVar[tuple[str, ...]]  # checkpoint prefixes of the pooling parts

    def __init__(self, config: Any, num_layers: int | None, with_pool: bool) -> None:
        super().__init__()
        spec = encoder_spec(config)
        self.total_layers = spec.num_layers
        self.image_size: int = config.image_size
        self.patch_size: int = config.patch_size
        self.encoder = Encoder(spec, spec.num_layers if num_layers is None else num_layers)
        self.with_pool = with_pool
        if with_pool:
            self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, N, h]
        """The input of the first encoder layer (transformers' hidden state 0)."""
        raise NotImplementedError

    def num_tokens(self, height: int, width: int) -> int:
        """Rows of each hidden state for one image: one per patch (and the class token)."""
        return (height // self.patch_size) * (width // self.patch_size) + self.has_class_token

    def hidden_states(
        self, pixel_values: torch.Tensor, indices: Sequence[int]
    ) -> list[torch.Tensor]:
        """transformers' output_hidden_states[i] for each i (negative counts from the end of
        the full tower's states; the last is before post_layernorm): [B, N, hidden] each."""
        check_image_size(pixel_values, self.image_size)
        resolved = [hidden_state_index(i, self.total_layers) for i in indices]
        _, kept = self.encoder(self.embed(pixel_values), keep=frozenset(resolved))
        return [kept[i] for i in resolved]

    def param_name(self, name: str) -> str | None:
        """Checkpoint name inside the tower -> parameter name; None for weights of parts
        not built (layers past the deepest read, the pooling parts)."""
        if name.startswith("encoder.layers."):
            layer = int(name.split(".")[2])
            if layer >= len(self.encoder.layers):
                return None
        if name.startswith(self.pool_parts) and not self.with_pool:
            return None
        return name


# for the engine: whole inputs in one step, no KV cache (CLIP's text tower masks causally
# inside itself); the runner pools texts and embeds images
DUAL_ENCODER = ModelCapabilities(causal=False, uses_kv_cache=False, dual_encoder=True)


class DualEncoder(ModelBase):
    """What CLIPModel and SiglipModel show the engine (a DualEncoderModel of
    mmserve.models.base): no KV cache, whole texts in one step through `text_model`
    (forward), vectors from pool_text() and embed_images() (theirs)."""

    num_layers = 0  # no KV cache
    dropped_weights: ClassVar[tuple[str, ...]] = ()  # checkpoint entries not needed to embed
    text_model: TextTransformer

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        text = hf_config.text_config
        self.num_kv_heads = text.num_attention_heads
        self.head_dim = text.hidden_size // text.num_attention_heads
        self.vocab_size: int = text.vocab_size
        self.max_text_len: int = text.max_position_embeddings

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, whole texts back to back
        positions: torch.Tensor,  # [T] int64, 0..n-1 within each text
        kv_caches: list[torch.Tensor],  # unused
        meta: AttentionMetadata,  # query_start_loc / query_lens_cpu delimit the texts
    ) -> torch.Tensor:  # [T, text hidden]
        return self.text_model(input_ids, positions, meta)  # type: ignore[no-any-return]

    def pool_text(self, hidden_rows: torch.Tensor, input_ids: list[int]) -> torch.Tensor:
        """One text's final rows [n, text hidden] (and its ids) -> its embedding (float32)."""
        raise NotImplementedError

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B, D]
        """The images' embeddings (float32, unnormalised)."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_by_name(self, weights, self._param_name)

    def _param_name(self, name: str) -> str | None:
        return None if is_buffer_name(name) or name in self.dropped_weights else name


class TextEmbeddings(nn.Module):
    def __init__(self, vocab_size: int, max_positions: int, hidden: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden)
        self.position_embedding = nn.Embedding(max_positions, hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(input_ids) + self.position_embedding(positions)


class TextTransformer(nn.Module):
    """CLIP's and SigLIP's text encoder over a flat batch of whole texts -> final-norm'd
    hidden states of every token. CLIP's is causal, SigLIP's bidirectional."""

    def __init__(self, config: Any, causal: bool) -> None:
        super().__init__()
        spec = encoder_spec(config)
        self.causal = causal
        self.max_positions: int = config.max_position_embeddings
        self.embeddings = TextEmbeddings(config.vocab_size, self.max_positions, spec.hidden_size)
        self.encoder = Encoder(spec, spec.num_layers)
        self.final_layer_norm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [T] ids, [T] positions -> [T, hidden]
        lengths = meta.query_lens_cpu
        if max(lengths) > self.max_positions:
            raise InvalidArgument("input_ids", f"a text is longer than {self.max_positions} tokens")
        x = self.embeddings(input_ids, positions)  # [T, hidden]
        valid = _valid_mask(lengths, x.device)  # [B, L]
        padded = x.new_zeros(*valid.shape, x.shape[-1])
        padded[valid] = x  # row-major order of valid is the flat batch's order
        mask = valid[:, None, None, :]  # [B, 1, 1, L]: keys of the own text only
        if self.causal:
            length = valid.shape[1]
            mask = mask & torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        out, _ = self.encoder(padded, mask)
        return self.final_layer_norm(out[valid])


def _valid_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[B, max length] bool: True where text b has a token."""
    arange = torch.arange(max(lengths), device=device)
    return arange[None, :] < torch.tensor(lengths, device=device)[:, None]


def load_by_name(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    param_name: Callable[[str], str | None],
) -> None:
    """Loads (HF name, tensor) pairs into module's parameters; param_name maps a checkpoint
    name to a parameter name, or None for an entry deliberately dropped. Raises on an unknown
    name or a parameter left unfilled."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        key = param_name(name)
        if key is None:
            continue
        if key not in params:
            raise UnsupportedModel(f"unexpected weight {name}")
        load_into(params[key], tensor, name)
        loaded.add(key)
    missing = set(params) - loaded
    if missing:
        raise UnsupportedModel(f"checkpoint lacks weights: {sorted(missing)[:8]}")


def is_buffer_name(name: str) -> bool:
    """Entries some checkpoints carry that are recomputed, never loaded."""
    return name.endswith(("position_ids", "inv_freq"))
