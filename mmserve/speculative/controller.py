"""When to speculate, for whom and how far: the engine core's side of speculative decoding.

A step speculates only while few requests run (SpeculativeConfig.disable_batch_size) and the
token budget has room for the guesses beside every scheduled token: under load, decode no
longer waits on reading the weights, and checking guesses would cost more than it saves.
Each request's guess length adapts to its acceptance: one more after a run accepted whole,
halved after a run refused whole, and after it reaches 0 the request rests RETRY_AFTER
steps before it tries one guess again, twice as long after each rest that ended in another
refusal (up to RETRY_AFTER << MAX_BACKOFF: a poor draft model, whose every try costs a
catch-up, stops costing); a request whose proposer found nothing EMPTY_LIMIT steps in a
row rests too. While every running request rests, the step does not speculate
at all: a speculating step waits for the step before it (its guesses follow the latest
token), and a step that does not keeps async scheduling's overlap."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from mmserve.config import SpeculativeConfig
from mmserve.request import Request
from mmserve.speculative import Proposer, ProposerContext, create_proposer, shown_method

RETRY_AFTER = 16  # steps a request whose guesses kept failing goes without
MAX_BACKOFF = 5  # that rest doubles after each failed retry, to at most 16 << 5 = 512 steps
EMPTY_LIMIT = 4  # proposals in a row that found nothing before a request rests


@dataclass
class _Adapt:
    k: int  # guesses it gets next
    drafts: int = 0  # its num_draft_tokens when last seen
    accepted: int = 0  # its num_accepted_draft_tokens when last seen
    rest: int = 0  # steps left without guesses
    empty: int = 0  # proposals in a row that found nothing
    retries: int = 0  # rests in a row that ended in a refusal (the next rest is longer)


class Speculator:
    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        if config.method is None:
            raise ValueError("speculative: no method")
        self.method = shown_method(config.method)  # (a draft by its name, not its path)
        self.k = config.num_speculative_tokens
        self.disable_batch_size = config.disable_batch_size
        self.proposer: Proposer = create_proposer(config.method, context)
        self.adaptive = True  # False: always k guesses (benchmarks of what a guess costs)
        self._adapt: dict[str, _Adapt] = {}

    def active(
        self, running: list[Request], waiting: Iterable[Request], budget: int, max_seqs: int
    ) -> bool:
        """Whether this step speculates: few requests run, and the tokens of every running
        request and of the waiting ones that could join now leave room for k guesses each."""
        if not running or len(running) > self.disable_batch_size:
            return False
        if self.adaptive and all(self._resting(r) for r in running):
            for request in running:  # a step goes by for each of them
                self._adapt[request.request_id].rest -= 1
            return False
        demand = sum(r.num_tokens - r.num_computed_tokens for r in running)
        demand += sum(
            r.num_tokens - r.num_computed_tokens
            for r in itertools.islice(waiting, max(0, max_seqs - len(running)))
        )
        return demand + len(running) * self.k <= budget

    def propose(self, running: list[Request]) -> None:
        """Sets draft_token_ids (and draft_probs) of each running request that decodes and
        may speculate."""
        chosen: list[Request] = []
        ks: list[int] = []
        for request in running:
            request.draft_token_ids, request.draft_probs = [], None
            k = self._next_k(request) if _may_speculate(request) else 0
            if k:
                chosen.append(request)
                ks.append(k)
        if not chosen:
            return
        for request, k, guesses in zip(chosen, ks, self.proposer.propose_batch(chosen, ks)):
            request.draft_token_ids = guesses.tokens[:k]
            if guesses.probs is not None and request.draft_token_ids:
                request.draft_probs = guesses.probs[:k]
            if self.adaptive:
                self._found(request, bool(request.draft_token_ids))

    def _resting(self, request: Request) -> bool:
        state = self._adapt.get(request.request_id)
        return state is not None and state.rest > 1

    def _found(self, request: Request, anything: bool) -> None:
        state = self._adapt[request.request_id]
        state.empty = 0 if anything else state.empty + 1
        if state.empty >= EMPTY_LIMIT:
            state.empty, state.rest = 0, RETRY_AFTER

    def _next_k(self, request: Request) -> int:
        if not self.adaptive:
            return self.k
        state = self._adapt.get(request.request_id)
        if state is None:
            state = self._adapt[request.request_id] = _Adapt(self.k)
        checked = request.num_draft_tokens - state.drafts
        if checked:
            accepted = request.num_accepted_draft_tokens - state.accepted
            if accepted:
                state.retries = 0
            if accepted == checked:
                state.k = min(self.k, state.k + 1)
            elif accepted == 0:
                state.k //= 2
                if state.k == 0:
                    state.rest = RETRY_AFTER << min(state.retries, MAX_BACKOFF)
                    state.retries += 1
            state.drafts, state.accepted = request.num_draft_tokens, request.num_accepted_draft_tokens
        if state.rest:
            state.rest -= 1
            if state.rest == 0:
                state.k = 1
            return 0
        return state.k

    def finished(self, request: Request) -> None:
        self._adapt.pop(request.request_id, None)
        self.proposer.finished(request)


def _may_speculate(request: Request) -> bool:
    """A generation that decodes (one token to compute, its value known) and did not opt out."""
    return (
        request.pooling is None
        and not request.params.disable_speculation
        and not request.num_pending
        and request.num_tokens - request.num_computed_tokens == 1
    )
