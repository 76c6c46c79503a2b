"""Generation without a model: a seeded random walk through what a grammar allows (the
structured-output tests, and `mmserve bench structured --schemas FILE`).

At each step the matcher fills a bitmask row and one allowed token is drawn. Early on the
draw is uniform (exploring odd corners: long tokens, whitespace, unicode); after
`soft_len` steps it draws single-character tokens, often ones that close things (quotes,
brackets), and ends as soon as a stop token is allowed, so walks terminate.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from functools import cached_property

import torch

from mmserve.structured_output import GrammarMatcher, allocate_bitmask, unpack_bitmask

_CLOSERS = (b'"', b"}", b"]", b")")


class WalkError(AssertionError):
    """The grammar led the walk nowhere: a dead end, a refused allowed token, no end."""


class Vocab:
    """Per-token facts the walk uses, as [V] bool tensors (fast to combine with a mask)."""

    def __init__(self, table: Sequence[bytes | None], eos_ids: Collection[int]) -> None:
        self.table = table
        self.size = len(table)
        self.eos = self._mask(lambda i, b: i in eos_ids)
        self.single = self._mask(lambda i, b: b is not None and len(b) == 1)
        self.closer = self._mask(lambda i, b: b in _CLOSERS)

    @cached_property
    def solid(self) -> torch.Tensor:
        return self.single & self._mask(lambda i, b: b is not None and not b.isspace())

    def _mask(self, pred: Callable[[int, bytes | None], bool]) -> torch.Tensor:
        return torch.tensor([pred(i, b) for i, b in enumerate(self.table)], dtype=torch.bool)

    def text(self, tokens: Sequence[int]) -> str:
        return b"".join(self.table[t] or b"" for t in tokens).decode("utf-8", errors="replace")


def walk(
    matcher: GrammarMatcher, vocab: Vocab, seed: int, soft_len: int = 30, max_steps: int = 800
) -> list[int]:
    """Token ids of one complete output (stop token excluded)."""
    # Small tensor ops on a busy machine: torch's thread pool only adds contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _walk(matcher, vocab, random.Random(seed), soft_len, max_steps)
    finally:
        torch.set_num_threads(threads)


def _walk(
    matcher: GrammarMatcher, vocab: Vocab, rng: random.Random, soft_len: int, max_steps: int
) -> list[int]:
    bitmask = allocate_bitmask(1, vocab.size)
    out: list[int] = []
    for step in range(max_steps):
        matcher.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, vocab.size)[0]
        if not allowed.any():
            raise WalkError(f"dead end after {vocab.text(out)!r}")
        token = _pick(allowed, vocab, rng, late=step >= soft_len)
        if not matcher.accept_token(token):
            raise WalkError(f"allowed token {token} was refused")
        if matcher.is_terminated():
            return out
        out.append(token)
    raise WalkError(f"no end after {max_steps} steps: {vocab.text(out)!r}")


def _pick(allowed: torch.Tensor, vocab: Vocab, rng: random.Random, late: bool) -> int:
    stops, others = allowed & vocab.eos, allowed & ~vocab.eos
    if stops.any() and (late or not others.any() or rng.random() < 0.15):
        return _draw(stops, rng)
    if not late:
        return _draw(others, rng)
    # Late: closers half the time, else any visible single character (whitespace would
    # only stop at the grammar's whitespace limit), else anything.
    closers = others & vocab.closer
    if closers.any() and rng.random() < 0.5:
        return _draw(closers, rng)
    for choice in (others & vocab.solid, others & vocab.single):
        if choice.any():
            return _draw(choice, rng)
    return _draw(others, rng)


def _draw(mask: torch.Tensor, rng: random.Random) -> int:
    ids = mask.nonzero().flatten()
    return int(ids[rng.randrange(len(ids))])
