"""What the engine hands back to its callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    """The log-probability of one token, with the top alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class EngineOutput:
    """One step's news for one request (engine level: token ids, no text)."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled this step (0 or 1 today; more with speculation)
    new_logprobs: list[TokenLogprob] | None  # one per new token when logprobs were asked
    prompt_logprobs: list[TokenLogprob | None] | None  # per prompt token, first one None
    finish_reason: str | None  # None = still running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the eos/stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0
    error: str | None = None  # set when the request failed inside the engine
    pooled: Any = None  # torch.Tensor (CPU, float32) for a pooling request that finished
    first_scheduled_time: float | None = None  # time.monotonic() of its first step, if any


@dataclass
class CompletionOutput:
    """One choice of a finished (or streaming) request, with text."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """The offline API's result for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = True

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": sum(len(o.token_ids) for o in self.outputs),
            "cached_tokens": self.num_cached_tokens,
        }
