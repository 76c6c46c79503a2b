"""Poolers: one input's hidden states -> an embedding, label scores or a score.

The runner calls the pooler once per pooling request with the final hidden states of all of
that input's tokens, so every method here sees exactly one input and needs no mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmserve.params import PoolingParams

POOLING_METHODS = ("cls", "mean", "max", "last")  # how token states become one vector
# softmax across labels, or one of the others on each label (identity: the raw logits)
ACTIVATIONS = ("softmax", "sigmoid", "tanh", "identity")
POOLER_SCORES = ("cross-encoder", "yes-token")  # score methods the pooler computes itself


class Pooler(Protocol):
    """Called once per pooling request, with the final hidden states of all its tokens
    ([num_tokens, hidden_size], in order); returns a 1-D result."""

    def __call__(self, hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor: ...


def pool_tokens(hidden: torch.Tensor, method: str) -> torch.Tensor:
    """[n, H] -> [H]. "cls" is the first token, "last" the last ([EOS] for decoders trained
    for it); "mean"/"max" run over all tokens, special ones included, as sentence-transformers
    does with an all-ones attention mask."""
    if method == "cls":
        return hidden[0]
    if method == "last":
        return hidden[-1]
    if method == "mean":
        return hidden.float().mean(0).to(hidden.dtype)
    if method == "max":
        return hidden.max(0).values
    raise ValueError(f"unknown pooling method {method!r}; choose one of {POOLING_METHODS}")


def pool_tokens_batch(
    hidden: torch.Tensor, starts: list[int], lengths: list[int], method: str
) -> torch.Tensor:
    """pool_tokens for several inputs at once: hidden [T, H] holds input i at rows
    starts[i] .. starts[i] + lengths[i]; returns [R, H] (a handful of kernels in all)."""
    device = hidden.device
    if method in ("cls", "last"):
        picked = starts if method == "cls" else [s + n - 1 for s, n in zip(starts, lengths)]
        return hidden[torch.tensor(picked).to(device, non_blocking=True)]  # no stream sync
    if method == "mean":
        lens = np.asarray(lengths, dtype=np.int64)
        owner_np = np.repeat(np.arange(len(lens)), lens)
        counts = torch.from_numpy(lens).to(device, non_blocking=True)
        owner = torch.from_numpy(owner_np).to(device, non_blocking=True)
        if starts == [0, *np.cumsum(lens[:-1]).tolist()] and lens.sum() == hidden.shape[0]:
            tokens = hidden  # the inputs are the whole batch, back to back (an embed step)
        else:
            first = np.repeat(np.asarray(starts, dtype=np.int64) - (lens.cumsum() - lens), lens)
            rows = torch.from_numpy(np.arange(len(owner_np)) + first)
            tokens = hidden[rows.to(device, non_blocking=True)]
        sums = torch.zeros(len(starts), hidden.shape[1], device=device, dtype=torch.float32)
        sums.index_add_(0, owner, tokens.float())
        return (sums / counts[:, None]).to(hidden.dtype)
    return torch.stack([pool_tokens(hidden[s : s + n], method) for s, n in zip(starts, lengths)])


def finish_embeddings(vectors: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """finish_embedding for a batch [R, H] sharing one PoolingParams."""
    vectors = vectors.float()
    if params.dimensions is not None:
        vectors = vectors[:, : params.dimensions]
    return F.normalize(vectors, p=2.0, dim=-1) if params.normalize else vectors


def finish_embedding(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation first, then L2 normalisation: a truncated Matryoshka vector is
    only unit-length if normalised after cutting."""
    vector = vector.float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector


def activate(logits: torch.Tensor, kind: str, enabled: bool) -> torch.Tensor:
    """Classifier logits [L] -> probabilities (or the logits when not enabled)."""
    if not enabled or kind == "identity":
        return logits
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    if kind == "tanh":
        return torch.tanh(logits)
    return torch.softmax(logits, dim=-1)


@dataclass(frozen=True)
class PoolerConfig:
    """How one model pools; decided at load time (mmserve.engine.pooling_setup)."""

    method: str  # one of POOLING_METHODS
    activation: str = "softmax"  # classifier activation, one of ACTIVATIONS
    # cross-encoder score activation, one of ACTIVATIONS: CrossEncoder.predict's default
    score_activation: str = "sigmoid"
    score: str | None = None  # how task "score" is answered here; None = not by the pooler
    yes_no_ids: tuple[int, int] | None = None  # yes-token scoring: ("yes", "no") token ids


class ModelPooler:
    """The Pooler of one model. Classifier models offer compute_class_logits([N, H]) ->
    [N, labels]; yes-token scoring uses the causal LM's compute_logits([N, H]) -> [N, vocab]."""

    def __init__(self, model: Any, config: PoolerConfig, head: nn.Module | None = None) -> None:
        self.model = model
        self.config = config
        # [R, H] pooled -> [R, D] embeddings: sentence-transformers' Dense modules, on the
        # model's device and dtype; None = the pooled vector is the embedding
        self.head = head

    def embed_batch(
        self, hidden: torch.Tensor, starts: list[int], lengths: list[int], params: PoolingParams
    ) -> torch.Tensor:
        """Embeddings [R, D] of several inputs sharing params (task "embed")."""
        pooled = pool_tokens_batch(hidden, starts, lengths, self.config.method)
        return finish_embeddings(self._project(pooled), params)

    def __call__(self, hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.task == "embed":
            pooled = pool_tokens(hidden, self.config.method)[None]
            return finish_embedding(self._project(pooled)[0], params)
        if params.task == "classify":
            logits = self._class_logits(hidden)
            return activate(logits, self.config.activation, params.activation)
        if self.config.score == "cross-encoder":
            logits = self._class_logits(hidden)  # single-logit head: relevance
            return activate(logits, self.config.score_activation, params.activation)
        if self.config.score == "yes-token" and self.config.yes_no_ids is not None:
            return self._yes_token_score(hidden, params.activation)
        raise RuntimeError(f"task {params.task!r} reached a pooler that cannot do it")

    def _project(self, pooled: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, D]
        return pooled if self.head is None else self.head(pooled)

    def _class_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [labels] float32
        pooled = pool_tokens(hidden, self.config.method)
        logits: torch.Tensor = self.model.compute_class_logits(pooled[None])
        return logits[0]

    def _yes_token_score(self, hidden: torch.Tensor, activation: bool) -> torch.Tensor:
        """P("yes") / (P("yes") + P("no")) at the answer position = sigmoid of the logit gap;
        the gap itself (log-odds) without activation. Shape [1]."""
        yes, no = self.config.yes_no_ids  # type: ignore[misc]
        logits = self.model.compute_logits(hidden[-1:])[0]  # [vocab] float32
        gap = (logits[yes] - logits[no]).reshape(1)
        return torch.sigmoid(gap) if activation else gap
