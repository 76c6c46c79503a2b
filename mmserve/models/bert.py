"""BERT and XLM-RoBERTa encoders, and their sequence-classification heads (cross-encoder
rerankers, plain classifiers).

Encoders see each input whole in one step and keep no KV cache (capabilities.uses_kv_cache
False):
attention goes through the backend with kv_cache None and meta.causal False, so each request
attends to all of its own tokens and nothing else. Checkpoint names follow transformers
(with or without the "bert." / "roberta." prefix) except the merged attention projection
`qkv` (query, key, value stacked on rows), so each layer runs one GEMM for all three.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from mmserve.attention import AttentionBackend, AttentionMetadata
from mmserve.errors import UnsupportedModel
from mmserve.models.base import ModelBase, ModelCapabilities
from mmserve.models.layers import add_layer_norm, load_into
from mmserve.models.parallel import (
    Shard,
    TensorParallel,
    columns,
    current,
    divide,
    first_rank_only,
    reduce,
    rows,
    vocab_embedding,
    vocab_rows,
)

# transformers' per-layer names (after "encoder.layer.{i}.") -> (our name, qkv row block or None)
_LAYER_NAMES = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("ffn_in", None),
    "output.dense": ("ffn_out", None),
    "output.LayerNorm": ("ffn_norm", None),
}
# Checkpoint entries that are buffers or heads we do not run (masked-LM heads, position ids).
_IGNORED_SUFFIXES = ("position_ids", "token_type_ids")
_IGNORED_PREFIXES = ("cls.", "lm_head.")
# bidirectional attention within each input, no KV cache; [CLS] pooling without
# sentence-transformers files (as vLLM does for BERT), and what the classifier heads read
_ENCODER = ModelCapabilities(
    causal=False, uses_kv_cache=False, default_pooling="cls", tensor_parallel=True
)
_CLASSIFIER = replace(_ENCODER, classifier=True)


@dataclass(frozen=True)
class BertSpec:
    """Everything the encoder needs, read once from the HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_positions: int  # rows of the position table
    type_vocab_size: int  # segment ids in [0, type_vocab_size); 1 = no segments (XLM-R)
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int | None


def bert_spec(hf_config: Any) -> BertSpec:
    kind = getattr(hf_config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise UnsupportedModel(f"position_embedding_type {kind!r}; only absolute is supported")
    if getattr(hf_config, "is_decoder", False):
        raise UnsupportedModel("BERT configured as a decoder (is_decoder) is not supported")
    return BertSpec(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        max_positions=hf_config.max_position_embeddings,
        type_vocab_size=getattr(hf_config, "type_vocab_size", 2),
        layer_norm_eps=hf_config.layer_norm_eps,
        hidden_act=hf_config.hidden_act,
        pad_token_id=getattr(hf_config, "pad_token_id", None),
    )


class Embeddings(nn.Module):
    def __init__(self, spec: BertSpec) -> None:
        super().__init__()
        self.word_embeddings = vocab_embedding(spec.vocab_size, spec.hidden_size)
        self.position_embeddings = nn.Embedding(spec.max_positions, spec.hidden_size)
        self.token_type_embeddings = nn.Embedding(spec.type_vocab_size, spec.hidden_size)
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        # transformers' order of additions, so that float rounding matches
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return add_layer_norm(self.LayerNorm, x, self.position_embeddings(positions))


class EncoderLayer(nn.Module):
    """Post-norm transformer layer: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, spec: BertSpec, backend: AttentionBackend) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        hidden = spec.hidden_size
        self.tp = tp = current()
        size = 1 if tp is None else tp.size
        self.num_heads, self.head_dim = spec.num_heads, hidden // spec.num_heads
        self.num_heads = divide(spec.num_heads, size, "the number of attention heads")
        self.local_size = self.num_heads * self.head_dim  # this rank's heads' width
        intermediate = divide(spec.intermediate_size, size, "intermediate_size")
        self.qkv = nn.Linear(hidden, 3 * self.local_size)
        self.attn_out = nn.Linear(self.local_size, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=spec.layer_norm_eps)
        self.ffn_in = nn.Linear(hidden, intermediate)
        self.act = ACT2FN[spec.hidden_act]
        self.ffn_out = nn.Linear(intermediate, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=spec.layer_norm_eps)
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def merged_rows(self, index: int) -> slice:
        """Rows of query (0), key (1) or value (2) inside qkv."""
        size = self.attn_out.in_features
        return slice(index * size, (index + 1) * size)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        num_tokens, width = x.shape[0], self.local_size
        q, k, v = (
            t.view(num_tokens, self.num_heads, self.head_dim)
            for t in self.qkv(x).split(width, dim=-1)
        )
        attn = self.backend.forward(q, k, v, None, meta, self.scale)
        attn = reduce(self.tp, self.attn_out(attn.reshape(num_tokens, width)))
        x = add_layer_norm(self.attn_norm, x, attn)
        ffn = reduce(self.tp, self.ffn_out(self.act(self.ffn_in(x))))
        return add_layer_norm(self.ffn_norm, x, ffn)


class BertModel(ModelBase):
    """The encoder: final hidden states of every token, [T, hidden]. Serves embeddings."""

    capabilities: ClassVar[ModelCapabilities] = _ENCODER
    checkpoint_prefix = "bert."
    # (checkpoint name, our module) of weights beyond the encoder; {} = none expected
    head_names: ClassVar[dict[str, str]] = {}

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec = bert_spec(hf_config)
        # the CausalLM-shaped facts the runner and engine read
        self.num_layers, self.vocab_size = spec.num_layers, spec.vocab_size
        self.num_kv_heads, self.head_dim = spec.num_heads, spec.hidden_size // spec.num_heads
        self.hidden_size = spec.hidden_size
        self.type_vocab_size = spec.type_vocab_size
        self.pad_token_id = spec.pad_token_id  # graph padding rows (EncoderGraphs) use it
        self.max_model_len = spec.max_positions - self.position_offset(spec)
        self.tp = current()
        self.embeddings = Embeddings(spec)
        self.layers = nn.ModuleList(
            EncoderLayer(spec, attention_backend) for _ in range(spec.num_layers)
        )

    @staticmethod
    def position_offset(spec: BertSpec) -> int:
        """Position of an input's first token in the position table."""
        return 0

    def positions_for(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return positions  # the runner numbers each input 0..n-1, as transformers does

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, whole inputs back to back
        positions: torch.Tensor,  # [T] int64, 0..n-1 within each input
        kv_caches: list[torch.Tensor],  # unused: encoders keep no cache
        meta: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # [T] int64 segment ids of text pairs
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embeddings(
            input_ids, self.positions_for(input_ids, positions, meta), token_type_ids
        )
        for layer in self.layers:
            x = layer(x, meta)
        return x

    def weight_shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """The part of checkpoint tensor `name` this rank holds (None: all of it)."""
        return bert_shard(self.spec, self.tp, name, shape) if self.tp is not None else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            key = self._load_one(params, name, tensor)
            if key is not None:
                loaded.add(key)
        expected = {f"{k}#{i}" if ".qkv." in k else k for k in params for i in range(3)}
        missing = expected - loaded
        if missing:
            raise UnsupportedModel(f"checkpoint lacks weights: {sorted(missing)[:8]}")

    def _load_one(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> str | None:
        """Loads one HF tensor; returns the key it fills, or None for an ignored entry."""
        name = name.removeprefix(self.checkpoint_prefix)
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias"
        )
        module, _, kind = name.rpartition(".")
        if name.endswith(_IGNORED_SUFFIXES) or name.startswith(_IGNORED_PREFIXES):
            return None
        if module in self.head_names:
            module = self.head_names[module]
        elif module.startswith("pooler."):
            return None  # BERT's pooler (dense + tanh) feeds only heads that declare it
        elif module.startswith("encoder.layer."):
            return self._load_layer_weight(params, module, kind, name, tensor)
        key = f"{module}.{kind}"
        if key not in params:
            raise UnsupportedModel(f"unexpected weight {name}")
        load_into(params[key], tensor, name)
        return key

    def _load_layer_weight(
        self,
        params: dict[str, nn.Parameter],
        module: str,
        kind: str,
        name: str,
        tensor: torch.Tensor,
    ) -> str:
        index, _, rest = module.removeprefix("encoder.layer.").partition(".")
        if rest not in _LAYER_NAMES:
            raise UnsupportedModel(f"unexpected weight {name}")
        ours, block = _LAYER_NAMES[rest]
        key = f"layers.{index}.{ours}.{kind}"
        if key not in params:
            raise UnsupportedModel(f"unexpected weight {name}")
        if block is None:
            load_into(params[key], tensor, name)
            return key
        layer = self.layers[int(index)]
        assert isinstance(layer, EncoderLayer)  # for the type checker: layers holds only these
        load_into(params[key], tensor, name, layer.merged_rows(block))
        return f"{key}#{block}"


# per-layer names (after "encoder.layer.{i}.") split over the ranks
_BERT_COLUMNS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "intermediate.dense",
)
_BERT_ROWS = ("attention.output.dense", "output.dense")


def bert_shard(
    spec: BertSpec, tp: TensorParallel, name: str, shape: tuple[int, ...]
) -> Shard | None:
    """Column-parallel query/key/value and the FFN's first dense, row-parallel attention
    output and the FFN's second (their biases on rank 0), word embeddings split over the
    vocabulary; positions, segments, norms and heads whole."""
    if name.endswith("word_embeddings.weight"):
        return vocab_rows(tp, spec.vocab_size)
    module, _, kind = name.rpartition(".")
    _, found, rest = module.partition("encoder.layer.")
    layer_part = rest.partition(".")[2] if found else ""
    if layer_part in _BERT_COLUMNS:
        return rows(tp, shape[0] // tp.size)
    if layer_part in _BERT_ROWS:
        return columns(tp, shape[1] // tp.size) if kind == "weight" else first_rank_only(tp)
    return None


class XLMRobertaModel(BertModel):
    """XLM-RoBERTa: BERT's encoder with positions counted from padding_idx + 1 and padding
    tokens at position padding_idx (fairseq's convention, as transformers computes it)."""

    capabilities: ClassVar[ModelCapabilities] = _ENCODER
    checkpoint_prefix = "roberta."

    @staticmethod
    def position_offset(spec: BertSpec) -> int:
        return (spec.pad_token_id or 0) + 1

    def positions_for(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        pad = self.spec.pad_token_id or 0
        is_token = (input_ids != pad).long()
        counts = is_token.cumsum(0)  # over the flat batch; rebased per input below
        starts = meta.query_start_loc
        before = torch.cat([counts.new_zeros(1), counts])[starts[:-1].long()]  # [num_reqs]
        # each token's input, found on the device (no host sync, so CUDA graphs can hold it);
        # rows past the last input (graph padding) take the last one's base
        rows = torch.arange(input_ids.shape[0], dtype=starts.dtype, device=starts.device)
        owner = torch.searchsorted(starts[1:], rows, right=True).clamp_(max=starts.shape[0] - 2)
        return (counts - before[owner]) * is_token + pad


class _ClassifierHead(nn.Module):
    """dense -> tanh -> out: BERT's pooler + classifier, and RoBERTa's classification head."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, num_labels)

    def forward(self, first_token: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, labels]
        return self.out(torch.tanh(self.dense(first_token)))


class _SequenceClassifier:
    """The classifier half of a *ForSequenceClassification model."""

    head: _ClassifierHead
    num_labels: int

    def _add_head(self, hf_config: Any, hidden: int) -> None:
        self.num_labels = hf_config.num_labels
        self.head = _ClassifierHead(hidden, self.num_labels)

    def compute_class_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token states -> [N, num_labels] float32 logits."""
        return self.head(pooled).float()


class BertForSequenceClassification(_SequenceClassifier, BertModel):
    """BERT + classifier on the first ([CLS]) token: classifiers and cross-encoders."""

    capabilities: ClassVar[ModelCapabilities] = _CLASSIFIER
    head_names: ClassVar[dict[str, str]] = {"pooler.dense": "head.dense", "classifier": "head.out"}

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend) -> None:
        super().__init__(hf_config, attention_backend)
        self._add_head(hf_config, self.hidden_size)


class XLMRobertaForSequenceClassification(_SequenceClassifier, XLMRobertaModel):
    """XLM-RoBERTa + classification head on <s>: bge-reranker and similar cross-encoders."""

    capabilities: ClassVar[ModelCapabilities] = _CLASSIFIER
    head_names: ClassVar[dict[str, str]] = {
        "classifier.dense": "head.dense",
        "classifier.out_proj": "head.out",
    }

    def __init__(self, hf_config: Any, attention_backend: AttentionBackend) -> None:
        super().__init__(hf_config, attention_backend)
        self._add_head(hf_config, self.hidden_size)
