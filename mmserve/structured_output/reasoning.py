"""A reasoning model's output constraint: free thought first, then the grammar.

ReasoningMatcher wraps a request's matcher (or none) and follows the output's thought with a
ThinkTracker (mmserve/processors/reasoning_parsers/gate.py): while the model thinks every token is
allowed (stop tokens too, unless a grammar waits: an answer it constrains must come); once
the end marker's tokens have been generated the inner grammar starts, from its start state.
At the request's reasoning_budget the end marker is forced, token by token. An output that
may open a thought (OPEN) may take the start marker or begin its answer under the grammar.

The markers are matched as token ids (Qwen3's and DeepSeek-R1's are single added tokens): a
model that spells `</think>` with other tokens stays in its thought here, to the budget or
max_tokens, although the text parser would see the marker.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Self

import torch

from mmserve.processors.reasoning_parsers import ANSWER, OPEN, ReasoningGate, ThinkTracker

from .backend import MAX_ROLLBACK_TOKENS, GrammarMatcher, allow_tokens, fill_bitmasks


class ReasoningMatcher(GrammarMatcher):
    """The gate before `inner` (None: a budget only, the answer is free)."""

    def __init__(
        self, gate: ReasoningGate, inner: GrammarMatcher | None, stop_ids: Iterable[int]
    ) -> None:
        self._gate = gate
        self._inner = inner
        self._stop_ids = sorted(stop_ids)
        self._tracker = ThinkTracker(gate)
        self._history: list[tuple[ThinkTracker, bool]] = []  # before each token; inner took it

    def _to_inner(self, token: int | None) -> bool:
        """Whether the token (None: the next one) belongs to the answer's grammar."""
        state = self._tracker.state
        if state == OPEN and self._gate.open_default == ANSWER:
            return token is None or self._gate.start_ids[:1] != (token,)
        return state == ANSWER

    def accept_token(self, token_id: int) -> bool:
        forced = self._tracker.forced()
        if forced is not None and token_id != forced:
            return False
        to_inner = self._inner is not None and self._to_inner(token_id)
        if to_inner and not self._inner.accept_token(token_id):  # type: ignore[union-attr]
            return False
        before = self._tracker.copy()
        self._tracker.feed(token_id)
        self._history.append((before, to_inner))
        del self._history[:-MAX_ROLLBACK_TOKENS]
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        type(self).fill_bitmasks([self], bitmask, [row], 1)

    @classmethod
    def fill_bitmasks(
        cls, matchers: Sequence[Self], bitmask: torch.Tensor, rows: Sequence[int], threads: int
    ) -> None:
        """The inner grammars of those in (or maybe at the start of) their answer in one
        batched fill, then each gate's own part."""
        inner = [(m._inner, r) for m, r in zip(matchers, rows, strict=True)
                 if m._inner is not None and m._tracker.forced() is None and m._to_inner(None)]  # fmt: skip
        if inner:
            fill_bitmasks([m for m, _ in inner], bitmask, [r for _, r in inner], threads)
        for matcher, row in zip(matchers, rows, strict=True):
            matcher._fill_own(bitmask[row])

    def _fill_own(self, words: torch.Tensor) -> None:
        forced = self._tracker.forced()
        if forced is not None:
            words.zero_()
            allow_tokens(words, [forced])
        elif self._inner is None or not self._to_inner(None):
            words.fill_(-1)  # thinking (or a free answer): every token
            if self._inner is not None:
                _deny_tokens(words, self._stop_ids)
        elif self._tracker.state == OPEN:  # the grammar's first tokens, or the start marker
            allow_tokens(words, self._gate.start_ids[:1])

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._history)} tokens")
        if not num_tokens:
            return
        undone = self._history[-num_tokens:]
        del self._history[-num_tokens:]
        inner_tokens = sum(took for _, took in undone)
        if inner_tokens and self._inner is not None:
            self._inner.rollback(inner_tokens)
        self._tracker = undone[0][0]

    def is_terminated(self) -> bool:
        return self._inner is not None and self._tracker.state == ANSWER and (
            self._inner.is_terminated()
        )

    def jump_forward(self) -> str:
        """The answer's grammar's forced text, once in the answer (none inside the thought)."""
        if self._inner is None or self._tracker.state != ANSWER:
            return ""
        return self._inner.jump_forward()

    def reset(self) -> None:
        self._tracker = ThinkTracker(self._gate)
        self._history.clear()
        if self._inner is not None:
            self._inner.reset()


def _deny_tokens(words: torch.Tensor, token_ids: Iterable[int]) -> None:
    """Disallow `token_ids` in one bitmask row ([W] int32, CPU)."""
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        if word < words.shape[0]:
            value = (int(words[word]) & 0xFFFFFFFF) & ~(1 << bit)
            words[word] = value - (1 << 32) if value >= 1 << 31 else value
