"""Tool-call parsing: the output types, the streaming driver every format builds on, and the
one-shot parse (the same machine fed the whole text at once, so the two always agree).

Contract (every format):
- A call is emitted once it is complete and valid, as one ToolCallDelta carrying its id,
  name and whole arguments, so a client never receives part of a call that later turns out
  malformed. Content streams as it arrives, except text that may still turn out to start a
  call, which is held until it is decided.
- Arguments are canonical compact JSON: `json.dumps(value, separators=(",", ":"),
  ensure_ascii=False)` of the parsed object. This is the same string whatever the chunking,
  and the same for every format (pythonic calls have no JSON text to pass through).
- A malformed call stays content, verbatim; so does a call the caller's `accept(name,
  arguments)` refuses (an unknown tool, arguments that break a strict tool's schema).
- Text outside calls is content, verbatim, except whitespace between a call and the start
  or the end of the content (so an output of calls only has empty content).
"""

from __future__ import annotations

import abc
import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, canonical compact form (see module doc)
    id: str = ""


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # 0, 1, ... in the order calls appear in the output
    id: str
    name: str
    arguments_delta: str  # all deltas of one index, concatenated, are its arguments JSON


Delta = ContentDelta | ToolCallDelta
Accept = Callable[[str, str], bool]  # (name, canonical arguments JSON) -> is it a call?


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def canonical_arguments(value: Any) -> str | None:
    """Compact JSON for a call's arguments, or None if they are not a JSON object."""
    if isinstance(value, str):  # some models quote the arguments object
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")  # a lone surrogate from a "\ud800" escape cannot be sent
    except (TypeError, ValueError, RecursionError):
        return None
    return text


def arguments_of(call: dict[str, Any]) -> Any:
    """A JSON call's arguments: "arguments", or "parameters" as some fine-tunes write; {}
    when neither is there (a call without parameters)."""
    return call.get("arguments", call.get("parameters", {}))


def loads_json(text: str) -> Any:
    """json.loads without NaN/Infinity (not JSON). Raises ValueError."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # nested deeper than Python's stack: not arguments we can use
        raise ValueError("nested too deeply") from None


def decode_json_prefix(text: str, start: int) -> tuple[Any, int]:
    """The JSON value at text[start:] and where it ends (json's raw_decode, without
    NaN/Infinity). Raises ValueError when there is no complete value there."""
    try:
        return _DECODER.raw_decode(text, start)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class StreamingToolParser(abc.ABC):
    """Feeds text deltas of one output; returns content and completed calls.

    Subclasses implement `_step`, consuming `self._buf` from the front through `_content`,
    `_call` and `_take`; the deltas it produces depend only on the text, never on how it
    was chunked (tests/tool_parsers checks this at every split).
    """

    def __init__(
        self, new_id: Callable[[], str] = random_call_id, accept: Accept | None = None
    ) -> None:
        self._new_id = new_id
        self._accept = accept  # None: every well-formed call is a call
        self._buf = ""  # text received but not yet turned into deltas
        self._final = False  # finish() was called: no more text will come
        self._out: list[Delta] = []
        self._calls = 0
        self._pending_ws = ""  # trailing whitespace of the content: dropped if it ends there
        self._content_started = False  # some non-whitespace content was emitted
        self._call_last = False  # a call came after the last non-whitespace content

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._run()

    def finish(self) -> list[Delta]:
        """End of output: decide everything held back."""
        self._final = True
        deltas = self._run()
        if self._buf:  # a subclass left text it could not place: it is content
            self._content(self._take(len(self._buf)))
        if self._pending_ws and not self._call_last:
            self._out.append(ContentDelta(self._pending_ws))
        self._pending_ws = ""
        return deltas + self._drain()

    @abc.abstractmethod
    def _step(self) -> bool:
        """Consume what can be decided from `self._buf`. False when more text is needed."""

    def _run(self) -> list[Delta]:
        while self._buf and self._step():
            pass
        return self._drain()

    def _drain(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _take(self, n: int) -> str:
        head, self._buf = self._buf[:n], self._buf[n:]
        return head

    def _content_until(self, marker: str) -> bool:
        """Emits the buffer as content up to marker and consumes the marker (True), or, with
        no marker yet, emits all but a tail that could start one (False)."""
        i = self._buf.find(marker)
        if i < 0:
            keep = 0 if self._final else held_prefix(self._buf, marker)
            self._content(self._take(len(self._buf) - keep))
            return False
        self._content(self._take(i))
        self._take(len(marker))
        return True

    def _content(self, text: str) -> None:
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        out = self._pending_ws + body
        if not self._content_started and self._calls:
            out = out.lstrip()  # the content starts after a call
        self._out.append(ContentDelta(out))
        self._content_started, self._call_last = True, False
        self._pending_ws = text[len(body) :]

    def _accepts(self, name: str, arguments: str) -> bool:
        return self._accept is None or self._accept(name, arguments)

    def _call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        self._call_last = True
        self._out.append(ToolCallDelta(self._calls, call_id or self._new_id(), name, arguments))
        self._calls += 1


class ToolParser:
    """One tool-call format: a one-shot `parse` and `stream()` for a streaming parser."""

    name: ClassVar[str]
    stream_class: ClassVar[type[StreamingToolParser]]
    # The format's marker strings. Where a model's tokenizer has them as special tokens, the
    # text given to the parser must keep them (see the package doc).
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        self.new_id = new_id or self.default_id

    @staticmethod
    def default_id() -> str:
        return random_call_id()

    def stream(self, accept: Accept | None = None) -> StreamingToolParser:
        """A parser for one output; calls `accept` refuses stay content."""
        return self.stream_class(self.new_id, accept)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        stream = self.stream()
        return collect(stream.feed(text) + stream.finish())


def collect(deltas: Sequence[Delta]) -> tuple[str, list[ToolCall]]:
    """Merge deltas into (content, calls): what a client ends up with."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
            continue
        prev = calls.get(d.index, ToolCall("", "", ""))
        calls[d.index] = ToolCall(
            prev.name + d.name, prev.arguments + d.arguments_delta, prev.id or d.id
        )
    return "".join(content), [calls[i] for i in sorted(calls)]


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: text that
    must be held back because the next delta may complete the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
