"""Reasoning parsing, the text side: an output's text -> its thought and its answer.

Contract (every format):
- The thought is the text between the start marker (`<think>`) and the end marker
  (`</think>`), verbatim; the markers are in neither part. The answer is what follows the end
  marker, its leading whitespace dropped.
- An output may open its thought itself (its first text, after whitespace, is the start
  marker) or start inside one (the prompt opened it: state THOUGHT). There too a start marker
  as its first text is dropped: a model whose template opened the thought may open it again.
- An output that ends inside its thought (a budget, max_tokens, EOS) is all thought.
- Streaming holds back only text that may still be a marker; the parts streamed never depend
  on how the text was chunked (tests/reasoning_parsers checks every split).
"""

from __future__ import annotations

from typing import ClassVar

from .gate import ANSWER, OPEN, THOUGHT

ReasoningParts = tuple[str, str]  # (thought text, answer text)


class ReasoningStream:
    """Feeds the text deltas of one output; returns (thought, answer) deltas."""

    def __init__(self, parser: ReasoningParser, state: str) -> None:
        self._start, self._end = parser.start, parser.end
        self._default = parser.open_default
        self.state = state  # OPEN, THOUGHT or ANSWER (gate.py)
        if state == THOUGHT:  # inside a thought, unless the output opens it (again) itself
            self.state, self._default = OPEN, THOUGHT
        self._buf = ""
        self._fresh_answer = False  # the answer just began after a thought: strip its start

    def feed(self, text: str) -> ReasoningParts:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ReasoningParts:
        return self._run(final=True)

    def _run(self, final: bool) -> ReasoningParts:
        thought: list[str] = []
        answer: list[str] = []
        while True:
            if self.state == OPEN and not self._open(final):
                break
            if self.state == THOUGHT:
                done, text = self._thought(final)
                thought.append(text)
                if not done:
                    break
            if self.state == ANSWER:
                answer.append(self._answer(final))
                break
        return "".join(thought), "".join(answer)

    def _open(self, final: bool) -> bool:
        """Decides whether the output opens a thought; False: not yet known."""
        body = self._buf.lstrip()
        if body.startswith(self._start):
            self._buf = body[len(self._start) :]
            self.state = THOUGHT
            return True
        if self._start.startswith(body) and not final:
            return False  # whitespace, or a start marker still arriving
        self.state = self._default
        return True

    def _thought(self, final: bool) -> tuple[bool, str]:
        """(whether the thought ended, the thought text decided)."""
        at = self._buf.find(self._end)
        if at >= 0:
            text, self._buf = self._buf[:at], self._buf[at + len(self._end) :]
            self.state, self._fresh_answer = ANSWER, True
            return True, text
        keep = 0 if final else _partial_suffix(self._buf, self._end)
        cut = len(self._buf) - keep
        text, self._buf = self._buf[:cut], self._buf[cut:]
        return False, text

    def _answer(self, final: bool) -> str:
        if self._fresh_answer:
            stripped = self._buf.lstrip()
            if not stripped:
                self._buf = ""
                return ""
            self._buf, self._fresh_answer = stripped, False
        text, self._buf = self._buf, ""
        return text


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """A reasoning format: its markers, and what an output that opens no thought is."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    open_default: ClassVar[str] = ANSWER  # an output that does not open a thought: answer

    def stream(self, state: str = OPEN) -> ReasoningStream:
        """A stream for one output starting in `state` (gate.find_state tells from the
        prompt: THOUGHT when the template opened the thought)."""
        return ReasoningStream(self, state)

    def parse(self, text: str, state: str = OPEN) -> ReasoningParts:
        """(thought, answer) of a whole output: the stream fed it at once."""
        stream = self.stream(state)
        thought, answer = stream.feed(text)
        more_thought, more_answer = stream.finish()
        return thought + more_thought, answer + more_answer
