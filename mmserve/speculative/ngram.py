"""Prompt lookup: the last n tokens (n from MAX_N down to MIN_N) are looked up in the
request's own prompt and output, and the k tokens that followed their latest earlier
occurrence are proposed. Each request keeps an index of its n-grams, extended by the tokens
that arrived since the step before: a step costs O(new tokens), not O(context)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mmserve.request import Request
from mmserve.speculative import Proposer

MIN_N, MAX_N = 2, 4


@dataclass
class History:
    """A request's tokens so far, and where each of their n-grams last ended."""

    tokens: list[int] = field(default_factory=list)
    # n-gram -> the position just after its latest occurrence. Ends up to the last token but
    # one are indexed, so looking up the context's own tail finds an earlier occurrence.
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed_to: int = 1  # ends [1, indexed_to) are in last_end

    def catch_up(self, request: Request) -> None:
        """Takes the request's tokens that arrived since the last call."""
        tokens, known = self.tokens, request.num_known_tokens
        if known > len(tokens):
            tokens += request.token_ids_range(len(tokens), known)
        for end in range(self.indexed_to, len(tokens)):
            for n in range(MIN_N, min(MAX_N, end) + 1):
                self.last_end[tuple(tokens[end - n : end])] = end
        self.indexed_to = max(self.indexed_to, len(tokens))

    def lookup(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest tail n-gram found
        (of the tokens followed by `after`: guesses ahead of these)."""
        tokens = [*self.tokens[-MAX_N:], *after] if after else self.tokens
        for n in range(min(MAX_N, len(tokens) - 1), MIN_N - 1, -1):
            end = self.last_end.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return self.tokens[end : end + k]
        return []


class NgramProposer(Proposer):
    def __init__(self) -> None:
        self._histories: dict[str, History] = {}

    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        history = self._histories.get(request.request_id)
        if history is None:
            history = self._histories[request.request_id] = History()
        history.catch_up(request)
        return history.lookup(k, after)

    def finished(self, request: Request) -> None:
        self._histories.pop(request.request_id, None)
