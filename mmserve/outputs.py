"""Results as callers read them: a token's logprobs (the sampler makes them) and the offline
API's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The log-probability of one token, with the top alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely token; tokens tied with it are not counted ahead of it
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


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
    # speculative decoding, over all choices: guesses checked, and those the model accepted
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": sum(len(o.token_ids) for o in self.outputs),
            "cached_tokens": self.num_cached_tokens,
            "draft_tokens": self.num_draft_tokens,
            "accepted_draft_tokens": self.num_accepted_draft_tokens,
        }
