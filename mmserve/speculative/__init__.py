"""Speculative decoding: a proposer guesses the next tokens of each decoding request, the
scheduler gives the request 1 + k tokens in the step, the model scores them in one pass, and
the runner keeps the guesses the target distribution agrees with (verify.py: lossless for
greedy and sampled requests alike). Proposers are registered by name and imported lazily."""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmserve.config import PREFILL_GRAPH_TOKENS
from mmserve.request import Request

# name -> "module:class"; a "+"-joined name chains proposers (the first ahead of the next);
# "draft=PATH" names the draft model's folder or GGUF file
PROPOSERS = {
    "ngram": "mmserve.speculative.ngram:NgramProposer",
    "suffix": "mmserve.speculative.suffix:SuffixProposer",
    "jump": "mmserve.speculative.jump_forward:JumpForwardProposer",
    "draft": "mmserve.speculative.draft:DraftProposer",
}


@dataclass
class Guesses:
    """A proposer's guesses for one request."""

    tokens: list[int] = field(default_factory=list)
    # [len(tokens), vocab] on the model's device: the distribution each token was drawn from
    # (a draft model sampling); None when they were chosen (looked up, forced, or greedy)
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may need of the engine it guesses for."""

    tokenizer: Any = None  # the model's (jump-forward tokenises forced text; a draft must match)
    vocab_size: int = 0  # the model's logits width
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    max_model_len: int = 4096
    max_batch: int = 8  # most requests that speculate in one step
    max_tokens: int = 2048  # the token budget of a step
    num_speculative_tokens: int = 4
    seed: int = 0
    cuda_graphs: bool = True  # capture graphs for a draft model's steps (CUDA only)
    prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS  # (the model's setting, for a bf16 draft)
    kv_cache_memory_bytes: int = 1 << 30  # the model's KV budget on the CPU
    load_format: str = "auto"  # the model's: a draft of a model with random weights has them too


class Proposer(abc.ABC):
    """Guesses continuations. propose_batch() is called once per step with the requests that
    may speculate; finished() once per request that ended (its state goes)."""

    @abc.abstractmethod
    def propose(self, request: Request, k: int, after: Sequence[int] = ()) -> list[int]:
        """At most k tokens that may follow the request's tokens (prompt + output), and
        after them the tokens `after` (another proposer's guesses ahead of these)."""

    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Guesses]:
        """Guesses for each request, at most ks[i] tokens (a draft model runs them as one
        batch; the others look each up)."""
        return [Guesses(self.propose(r, k)) for r, k in zip(requests, ks, strict=True)]

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
        alone = max((p.propose(request, k, after) for p in self.proposers[1:]), key=len, default=[])
        return chain if len(chain) >= len(alone) else alone

    def finished(self, request: Request) -> None:
        for proposer in self.proposers:
            proposer.finished(request)


def create_proposer(method: str, context: ProposerContext | None = None) -> Proposer:
    """The proposer of a --speculative method ("ngram", "jump+suffix", "draft=PATH", ...)."""
    context = context or ProposerContext()
    parts = []
    for part in method.split("+"):
        name, _, argument = part.partition("=")
        target = PROPOSERS.get(name)
        if target is None or bool(argument) != (name == "draft"):
            raise ValueError(
                f"speculative: unknown proposer {part!r}; valid: "
                + ", ".join("draft=PATH" if n == "draft" else n for n in sorted(PROPOSERS))
            )
        module, cls = target.split(":")
        proposer_cls = getattr(importlib.import_module(module), cls)
        if name == "jump":
            parts.append(proposer_cls(context.tokenizer))
        elif name == "draft":
            parts.append(proposer_cls(argument, context))
        else:
            parts.append(proposer_cls())
    return parts[0] if len(parts) == 1 else ChainedProposer(parts)


def shown_method(method: str) -> str:
    """The method as ListModels and logs show it: a draft model by its name, not its path."""
    parts = []
    for part in method.split("+"):
        name, _, argument = part.partition("=")
        parts.append(
            f"draft={argument.rstrip('/').rsplit('/', 1)[-1]}" if name == "draft" else part
        )
    return "+".join(parts)
