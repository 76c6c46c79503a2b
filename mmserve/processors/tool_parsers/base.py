"""Tool-call parsing: the output types, the streaming driver every format builds on, and the
one-shot parse (the same machine fed the whole text at once, so the two always agree).

Contract (every format):
- A call is emitted once it is complete and valid, as one ToolCallDelta carrying its id,
  name and whole arguments, so a client never receives part of a call that later turns out
  malformed. Content streams as it arrives, except text that may still turn out to be part
  of a call, which is held until it is decided: a tail that may start a marker, a call
  being read, and (untagged calls, below) an output that starts with `{`, `[` or "```".
- Arguments are canonical compact JSON: `json.dumps(value, separators=(",", ":"),
  ensure_ascii=False)` of the parsed object (a number beyond float's range kept as
  written). This is the same string whatever the chunking, and the same for every format
  (pythonic calls have no JSON text to pass through).
- A malformed call stays content, verbatim; so does a call the caller's `accept(name,
  arguments)` refuses (an unknown tool, arguments that break a strict tool's schema), and
  a call that repeats a key (JSON) or a keyword argument (pythonic): it is not a call,
  rather than one whose value depends on which copy a reader keeps.
- Text outside calls is content, verbatim, except whitespace between a call and the start
  or the end of the content (so an output of calls only has empty content), and a
  format's separator between calls (llama3_json's `;`). An output in which no call is
  found comes back as content exactly, every character and marker included.
- Untagged calls (hermes, llama3_json, mistral, where the request has tools, i.e. an
  `accept`): small models asked for a call often answer with the call object but without
  the format's markers. An output that, after whitespace and one ``` code fence (```json
  or ```), is entirely one call object `{"name": ..., "arguments": {...}}` or a JSON array
  of them, every one accepted, is those calls. Anything else is read as the format says.
  So an output that starts with `{`, `[` or a fence is held back until it is decided: when
  its value closes as something else than calls, when text follows it, or at the end (a
  client streaming such an answer gets it when the JSON closes, or at the end).
- Time is linear in the length of the output, however it is chunked (reader.py, scan.py):
  no text is scanned again for each delta, or for each marker of a malformed output.
"""

from __future__ import annotations

import abc
import json
import math
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .reader import Reader
from .scan import BalancedScanner, Scan


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
            value = loads_json(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    try:
        text = _ENCODER.encode(value)
        text.encode("utf-8")  # a lone surrogate from a "\ud800" escape cannot be sent
    except (TypeError, ValueError, RecursionError):
        return None
    return _BIG_NUMBER.sub(r"\1", text) if _NONCE in text else text


def arguments_of(call: dict[str, Any]) -> Any:
    """A JSON call's arguments: "arguments", or "parameters" as some fine-tunes write; {}
    when neither is there (a call without parameters)."""
    return call.get("arguments", call.get("parameters", {}))


def json_call(value: Any, need_arguments: bool = False) -> tuple[str, str] | None:
    """(name, canonical arguments) of a call object `{"name": ..., "arguments": {...}}`, or
    None. need_arguments: the arguments must be there (where the object has no marker
    around it, the keys are all that tells a call from other JSON)."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    if need_arguments and "arguments" not in value and "parameters" not in value:
        return None
    arguments = canonical_arguments(arguments_of(value))
    return None if arguments is None else (name, arguments)


def loads_json(text: str) -> Any:
    """json.loads without NaN/Infinity (not JSON) and without repeated keys (which copy
    counts is up to the reader). Raises ValueError."""
    try:
        return _DECODER.decode(text)
    except RecursionError:  # nested deeper than Python's stack: not arguments we can use
        raise ValueError("nested too deeply") from None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ValueError("a key is repeated")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@dataclass(frozen=True)
class _BigNumber:
    """A JSON number beyond Python's float range or int digit limit, as written: JSON numbers
    have no range, so `1E400` is valid arguments (a grammar for `"type": "number"` lets it
    through) and must not turn a call into content."""

    text: str


def _parse_float(text: str) -> float | _BigNumber:
    value = float(text)
    return value if math.isfinite(value) else _BigNumber(text)


def _parse_int(text: str) -> int | _BigNumber:
    try:
        return int(text)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        return _BigNumber(text)


# A _BigNumber is encoded as the string `_NONCE + text`, then unquoted (the encoder cannot
# write raw text; its digits, sign and exponent need no escaping).
_NONCE = secrets.token_hex(16)
_BIG_NUMBER = re.compile(f'"{_NONCE}([^"]*)"')


def _encode_big(value: Any) -> str:
    if isinstance(value, _BigNumber):
        return _NONCE + value.text
    raise TypeError(f"{type(value).__name__} is not JSON")


# Made once: json.dumps / json.loads with options build a new coder on every call.
_ENCODER = json.JSONEncoder(
    separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_encode_big
)
_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant,
    parse_float=_parse_float,
    parse_int=_parse_int,
    object_pairs_hook=_unique,
)


class StreamingToolParser(abc.ABC):
    """Feeds text deltas of one output; returns content and completed calls.

    Subclasses are state machines: `_state` is the method that reads on from the cursor of
    `self._in` (reader.py), returning False when it cannot go on: it needs more text, or, at
    the end of the output, nothing is left to decide (a state never waits once the text is
    final). What they decide is given out through `_emit_to` (content) and `_call`. The deltas depend only on the text, never on how it was chunked
    (tests/tool_parsers checks this at every split).
    """

    def __init__(
        self, new_id: Callable[[], str] = random_call_id, accept: Accept | None = None
    ) -> None:
        self._new_id = new_id
        self._accept = accept  # None: every well-formed call is a call
        self._in = Reader()
        self._state: Callable[[], bool] = self._start
        self._out: list[Delta] = []
        self._text_out: list[str] = []  # content not yet in a delta
        self._calls = 0
        self._ws: list[str] = []  # trailing whitespace of the content: dropped if it ends there
        self._content_started = False  # some non-whitespace content was emitted
        self._call_last = False  # a call came after the last non-whitespace content

    def feed(self, text: str) -> list[Delta]:
        self._in.append(text)
        return self._run()

    def finish(self) -> list[Delta]:
        """End of output: decide everything held back."""
        self._in.final = True
        while self._state():
            pass
        if not self._in.at_end():  # a state left text it could not place: it is content
            self._emit_to(self._in.end)
        if self._ws and not self._call_last:
            self._text_out.append("".join(self._ws))
        self._ws = []
        return self._drain()

    @abc.abstractmethod
    def _start(self) -> bool:
        """The first state."""

    def _run(self) -> list[Delta]:
        while self._state():
            pass
        return self._drain()

    def _drain(self) -> list[Delta]:
        self._flush()
        out, self._out = self._out, []
        return out

    def _flush(self) -> None:
        if self._text_out:
            self._out.append(ContentDelta("".join(self._text_out)))
            self._text_out = []

    def _emit_to(self, stop: int) -> None:
        """The text from `keep` to `stop` is content; reading goes on from `stop`."""
        reader = self._in
        if stop > reader.keep:
            self._content(reader.text(reader.keep, stop))
        reader.pos = reader.keep = stop

    def _content_until(self, marker: str | re.Pattern[str], held: str) -> int | None:
        """Emits content up to the next match of `marker` and returns where it is; with no
        match yet, emits all but a tail that could start `held` and returns None."""
        reader = self._in
        text, base = reader.window()
        start = reader.pos - base
        if isinstance(marker, str):
            i = text.find(marker, start)
        else:
            match = marker.search(text, start)
            i = match.start() if match else -1
        if i < 0:
            keep = 0 if reader.final else held_prefix(text, held, start)
            self._emit_to(base + len(text) - keep)
            return None
        self._emit_to(base + i)
        return base + i

    def _content(self, text: str) -> None:
        body = text.rstrip()
        if not body:
            self._ws.append(text)
            return
        out = "".join(self._ws) + body
        if not self._content_started and self._calls:
            out = out.lstrip()  # the content starts after a call
        self._text_out.append(out)
        self._content_started, self._call_last = True, False
        self._ws = [text[len(body) :]]

    def _idle(self) -> bool:
        """The state after the output is decided to its end."""
        return False

    def _all_content(self) -> bool:
        """From `keep` to the end, the output is content."""
        self._in.pos = self._in.keep
        self._state = self._content_to_end
        return True

    def _content_to_end(self) -> bool:
        self._emit_to(self._in.end)
        return False

    def _scan(self, scanner: BalancedScanner) -> Scan | None:
        """Reads on with the scanner: how its value ended (NEED_MORE: cut off by the end of
        the output), or None while more text may still end it."""
        state = self._in.scan(scanner)
        return None if state is Scan.NEED_MORE and not self._in.final else state

    def _json_of(self, scanner: BalancedScanner) -> Any:
        """The JSON value a scanner found the end of; None if it is not JSON."""
        try:
            return loads_json(self._in.text(scanner.start, scanner.pos))
        except ValueError:
            return None

    def _accepts(self, name: str, arguments: str) -> bool:
        return self._accept is None or self._accept(name, arguments)

    def _call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        self._flush()
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
        """A parser for one output; calls `accept` refuses stay content. Untagged calls
        (module doc) are only read where there is an `accept`: the request's tools."""
        return self.stream_class(self.new_id, accept)

    def parse(self, text: str, accept: Accept | None = None) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        stream = self.stream(accept)
        return collect(stream.feed(text) + stream.finish())

    def call_tags(self, tools: Sequence[tuple[str, Any]]) -> dict[str, Any] | None:
        """xgrammar's triggered_tags format (a structural tag's) in which text is free but a
        call, once its marker is written, must name one of `tools` ((name, arguments schema)
        pairs) and end with arguments its schema validates, in this format's own markup;
        None: the format has no marker to trigger on (the default)."""
        return None


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


def held_prefix(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of `marker`:
    text that must be held back because the next delta may complete the marker."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
