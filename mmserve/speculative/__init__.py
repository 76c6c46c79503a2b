"""Speculative decoding: a proposer guesses the next tokens of each decoding request, the
scheduler gives the request 1 + k tokens in the step, the model scores them in one pass, and
the runner keeps the guesses the target distribution agrees with (verify.py: lossless for
greedy and sampled requests alike). Proposers are registered by name and imported lazily."""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence

from mmserve.request import Request

# name -> "module:class"; a "+"-joined name chains proposers (the longest guess wins)
PROPOSERS = {
    "ngram": "mmserve.speculative.ngram:NgramProposer",
    "suffix": "mmserve.speculative.suffix:SuffixProposer",
    "jump": "mmserve.speculative.jump_forward:JumpForwardProposer",
}


class Proposer(abc.ABC):
    """Guesses continuations. propose() is called once per step for the requests that may
    speculate; finished() once per request that ended (its state goes)."""

    @abc.abstractmethod
    def propose(self, request: Request, k: int) -> list[int]:
        """At most k tokens that may follow the request's tokens (prompt + output)."""

    def finished(self, request: Request) -> None:
        """The request ended: drop what was kept for it (or learn from its output)."""


class ChainedProposer(Proposer):
    """Several proposers: the longest guess wins, the earlier proposer on a tie (so
    jump+suffix takes the grammar's forced text unless the suffix trie has seen more)."""

    def __init__(self, proposers: Sequence[Proposer]) -> None:
        self.proposers = list(proposers)

    def propose(self, request: Request, k: int) -> list[int]:
        best: list[int] = []
        for proposer in self.proposers:
            tokens = proposer.propose(request, k)
            if len(tokens) > len(best):
                best = tokens
        return best

    def finished(self, request: Request) -> None:
        for proposer in self.proposers:
            proposer.finished(request)


def create_proposer(method: str, tokenizer: object = None) -> Proposer:
    """The proposer of a --speculative method ("ngram", "jump+suffix", ...). tokenizer: the
    model's (jump-forward turns a grammar's forced text into tokens with it)."""
    parts = []
    for name in method.split("+"):
        target = PROPOSERS.get(name)
        if target is None:
            raise ValueError(
                f"speculative: unknown proposer {name!r}; valid: {', '.join(sorted(PROPOSERS))}"
            )
        module, cls = target.split(":")
        proposer_cls = getattr(importlib.import_module(module), cls)
        parts.append(proposer_cls(tokenizer) if name == "jump" else proposer_cls())
    return parts[0] if len(parts) == 1 else ChainedProposer(parts)
