"""A request's state as the engine sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from mmserve.inputs import MMInput, MMPlaceholder
from mmserve.params import PoolingParams, SamplingParams

PLACEHOLDER = -1  # a token sampled by the step in flight; the runner fills it in on the device


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, not holding KV blocks
    RUNNING = "running"  # holding KV blocks, scheduled each step
    PREEMPTED = "preempted"  # blocks taken back; recomputed from scratch when rescheduled
    FINISHED_STOPPED = "stop"  # eos, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"  # cancelled by the client or failed

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass
class Request:
    """The engine's state of one sequence: a generation, or one pooling input (pooling set:
    its whole input runs in one step and is pooled, nothing is sampled).

    Invariant: num_computed_tokens <= num_tokens; the scheduler lets num_computed_tokens catch
    up with num_tokens, and a token is sampled whenever the two meet. There is no prefill or
    decode phase."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]  # tokens that end the output unless ignore_eos
    max_tokens: int  # resolved output cap (params.max_tokens or the context room)
    cache_salt: str | None = None  # isolates this request's prefix-cache blocks
    mm_inputs: tuple[MMInput, ...] = ()  # images in the prompt, in order
    mrope_positions: Any = None  # [3, num_prompt_tokens] int64 tensor for multimodal rotary
    mrope_delta: int = 0  # a generated token at index i has (multimodal) position i + delta
    pooling: PoolingParams | None = None  # set for embed/classify/score: pooled, not sampled
    token_type_ids: list[int] | None = None  # segment ids of a text pair (BERT-style encoders)
    grammar: Any = None  # a structured_output GrammarMatcher fed every sampled token, or None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or is being computed)
    # tokens sampled by a step still in flight (async scheduling): counted in num_tokens, their
    # values not known on the host yet (PLACEHOLDER in token_ids_range)
    num_pending: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache (-1 = not yet known)
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks so far
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # speculative decoding (mmserve/speculative): the proposer's guesses of the tokens after
    # the last one, for the next step to verify; never in output_token_ids or block hashes
    # until the model has verified them
    draft_token_ids: list[int] = field(default_factory=list)
    # [len(draft_token_ids), vocab] on the device: the distribution a draft model drew each
    # guess from (None: the guesses were chosen, not drawn); verification needs it
    draft_probs: Any = None
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_draft_tokens: int = 0  # of those, the ones the model agreed with
    # params.allowed_token_ids as a set, made the first time the scheduler checks a token
    # against them (Scheduler._forbidden)
    allowed_token_set: frozenset[int] | None = None

    @property
    def mm_placeholders(self) -> tuple[MMPlaceholder, ...]:
        """Where the images sit: prefix-cache keys by image content."""
        return tuple(mm.placeholder for mm in self.mm_inputs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are on the host (num_tokens less the pending ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole list; pending
        tokens (sampled by the step in flight) read as PLACEHOLDER."""
        known = self.num_known_tokens
        if end > known:
            if start >= known:  # all pending (the usual decode step, async scheduling)
                return [PLACEHOLDER] * (end - start)
            return self.token_ids_range(start, known) + [PLACEHOLDER] * (end - known)
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
