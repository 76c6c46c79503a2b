"""Speculative decoding: a proposer guesses the next tokens of each decoding request, the
scheduler gives the request 1 + k tokens in the step, the model scores them in one pass, and
the runner keeps the guesses the target distribution agrees with (verify.py: lossless for
greedy and sampled requests alike). Proposers are registered by name and imported lazily."""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence

from mmserve.request import Request

# name -> "module:class"; a "+"-joined name chains proposers (the first ahead of the next)
PROPOSERS = {
    "ngram": "mmserve.speculative.ngram:NgramProposer",
    "suffix": "mmserve.speculative.suffix:SuffixProposer",
    "jump": "mmserve.speculative.jump_forward:JumpForwardProposer",
}


class Proposer(abc.ABC):
    """Guesses continuations. propose() is called once per step for the requests that may
    speculate; finished() once per request that ended (its state goes)."""

    @abc.abstractmethod
    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        """At most k tokens that may follow the request's tokens (prompt + output), and
        after them the tokens `after` (another proposer's guesses ahead of these)."""

    def finished(self, request: Request) -> None:
        """The request ended: drop what was kept for it (or learn from its output)."""


class ChainedProposer(Proposer):
    """Several proposers, the first ahead of the others: its guesses, then the next one's
    guesses of what follows them, and so on up to k (jump+suffix: a grammar's forced text,
    then what the suffix trie saw after it). A longer guess of one proposer alone wins over
    that chain (the trie may have seen the forced text too, in the model's own tokens)."""

    def __init__(self, proposers: Sequence[Proposer]) -> None:
        self.proposers = list(proposers)

    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        chain: list[int] = []
        for proposer in self.proposers:
            if len(chain) >= k:
                break
            more = proposer.propose(request, k - len(chain), [*after, *chain])
            if not more and chain:
                break  # the chain ends where a proposer has nothing to follow it
            chain += more
        alone = max(
            (p.propose(request, k, after) for p in self.proposers[1:]), key=len, default=[]
        )
        return chain if len(chain) >= len(alone) else alone

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
