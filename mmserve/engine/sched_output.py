"""What the scheduler hands the runner each step, and what the runner hands back: data only,
in its own module so that the runner imports data, not the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmserve.inputs import MMInput
from mmserve.outputs import TokenLogprob
from mmserve.params import PoolingParams, SamplingParams


@dataclass
class ScheduledRequest:
    """What the runner needs to compute one request's share of a step."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step, at positions start_pos, start_pos + 1, ..
    start_pos: int  # tokens already in the KV cache (num_computed_tokens before this step)
    block_ids: list[int]  # the request's KV blocks, in order; enough for start_pos + len(token_ids)
    sample: bool  # this step reaches the last known token, so a new token is sampled
    params: SamplingParams
    prompt_token_ids: list[int]  # shared with the request (read-only): repetition penalty, targets
    output_token_ids: list[int]  # shared with the request (read-only): penalties, min_tokens
    eos_token_ids: frozenset[int]  # masked while fewer than min_tokens are out
    pooling: PoolingParams | None = None  # set when this step pools the request's whole input
    token_type_ids: list[int] | None = None  # segment ids of token_ids (pair encoders)
    grammar: Any = None  # the request's GrammarMatcher when it samples under a constraint
    mm_inputs: tuple[MMInput, ...] = ()  # images whose placeholder tokens this step computes
    mrope_positions: Any = None  # the request's [3, num_prompt_tokens] positions (Qwen2-VL)
    mrope_delta: int = 0  # position offset of generated tokens under multimodal rotary
    # leading block_ids that are those of this request's previous step (0: treat all as new);
    # lets the runner keep block tables across steps and write only the new ids
    num_kept_blocks: int = 0
    # speculative decoding: guesses of the tokens after the last one; they end token_ids (so
    # the step computes them too) and the step checks them (sample is then True)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None  # [len(draft_token_ids), vocab]: what they were drawn from (or None)


@dataclass
class SchedulerOutput:
    """One step's plan. Requests appear in batch order."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step: drop state
    num_preempted: int = 0
    encoder_free: list[str] = field(default_factory=list)  # image-encoder outputs to drop

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    """The runner's answer for one request that sampled."""

    token_id: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)  # request id -> new token
    # speculative decoding: request id -> the guesses the model accepted, which come before
    # its `sampled` token (the model's own at the first rejected guess, or after the last)
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> result (CPU)
    # request id -> (position of the first target token, logprobs of this chunk's prompt tokens)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # the requests whose grammar refused their sampled token, where the runner put the tokens
    # into the matchers (ModelRunner.start_grammars); None: the scheduler's update does
    grammar_refused: set[str] | None = None
