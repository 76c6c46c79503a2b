"""The token side of reasoning: where a thought ends, counted on token ids.

The engine (a budget, a grammar that starts after the thought: structured_output/reasoning.py)
and the usage count (`reasoning_tokens`) both follow an output token by token with a
ThinkTracker. It matches the markers' token ids as the tokenizer encodes them alone: Qwen3's
and DeepSeek-R1's `<think>` and `</think>` are single added tokens. A marker the model spells
with other tokens is still read by the text parser, but not seen here (documented limit).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

OPEN, THOUGHT, ANSWER = "open", "thought", "answer"


@dataclass(frozen=True)
class ReasoningGate:
    """How one output's thought is told apart, in token ids (EngineRequest.reasoning)."""

    state: str  # at the output's start: OPEN (it may open a thought), THOUGHT or ANSWER
    start_ids: tuple[int, ...]  # `<think>` as tokens
    end_ids: tuple[int, ...]  # `</think>` as tokens (non-empty)
    open_default: str = ANSWER  # OPEN, when the first token does not open a thought
    budget: int | None = None  # most thought tokens before `</think>` is forced


@dataclass
class ThinkTracker:
    """One output's position relative to its thought, fed one token at a time."""

    gate: ReasoningGate
    state: str = ""
    reasoning_tokens: int = 0  # tokens of the thought, its markers included
    body: int = 0  # thought tokens that are not (part of) the end marker
    matched: int = 0  # tokens of the end marker seen so far, in a row

    def __post_init__(self) -> None:
        self.state = self.state or self.gate.state

    def copy(self) -> ThinkTracker:
        return replace(self)

    def feed(self, token: int) -> None:
        gate = self.gate
        if self.state == OPEN:
            if gate.start_ids[:1] == (token,):
                self.state, self.reasoning_tokens = THOUGHT, self.reasoning_tokens + 1
                return
            self.state = gate.open_default
        if self.state != THOUGHT:
            return
        self.reasoning_tokens += 1
        if gate.end_ids[self.matched] == token:
            self.matched += 1
            if self.matched == len(gate.end_ids):
                self.state, self.matched = ANSWER, 0
            return
        self.body += self.matched  # a partial marker was thought after all
        self.matched = 0
        if gate.end_ids[0] == token:
            self.matched = 1
            if len(gate.end_ids) == 1:
                self.state, self.matched = ANSWER, 0
        else:
            self.body += 1

    def forced(self) -> int | None:
        """The token the budget forces next (the end marker's next one), or None."""
        budget = self.gate.budget
        if self.state == THOUGHT and budget is not None and self.body >= budget:
            return self.gate.end_ids[self.matched]
        return None


def find_state(
    prompt_ids: list[int], start_ids: tuple[int, ...], end_ids: tuple[int, ...], default: str
) -> str:
    """Where an output starts: THOUGHT after a prompt whose last marker opens a thought (a
    template that opened it: `...<think>\\n`), OPEN after one that closed it or has none
    (`default` decides what an output that opens no thought is)."""
    start, end = _last(prompt_ids, start_ids), _last(prompt_ids, end_ids)
    if start > end:
        return THOUGHT
    return OPEN if end < 0 or default == ANSWER else ANSWER


def _last(ids: list[int], marker: tuple[int, ...]) -> int:
    n = len(marker)
    if not n:
        return -1
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i : i + n]) == marker:
            return i
    return -1
