"""Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of times, with text around. Used by Qwen2.5, Qwen3, Hermes 2/3 and others."""

from __future__ import annotations

from .base import (
    StreamingToolParser,
    ToolParser,
    arguments_of,
    canonical_arguments,
    loads_json,
)
from .scan import BalancedScanner, Scan

START, END = "<tool_call>", "</tool_call>"


class HermesStream(StreamingToolParser):
    _scanner: BalancedScanner | None = None  # set while inside <tool_call>

    def _step(self) -> bool:
        return self._text() if self._scanner is None else self._inside()

    def _text(self) -> bool:
        if not self._content_until(START):
            return False
        # An end tag outside a string means the JSON was cut short: stop there.
        self._scanner = BalancedScanner(opening="{", abort=END)
        return True

    def _inside(self) -> bool:
        assert self._scanner is not None
        state = self._scanner.scan(self._buf)
        if state is Scan.NEED_MORE and not self._final:
            return False
        if state is not Scan.END:
            return self._malformed()
        end = self._scanner.pos
        rest = self._buf[end:]
        gap = len(rest) - len(rest.lstrip())
        tail = rest[gap:]
        if tail.startswith(END) or (self._final and not tail):  # a missing end tag at EOF
            return self._complete(end, min(len(self._buf), end + gap + len(END)))
        if END.startswith(tail) and not self._final:
            return False
        return self._malformed()

    def _complete(self, json_end: int, region_end: int) -> bool:
        try:
            value = loads_json(self._buf[:json_end])
        except ValueError:
            return self._malformed()
        name = value.get("name") if isinstance(value, dict) else None
        arguments = canonical_arguments(arguments_of(value)) if name else None
        if not isinstance(name, str) or arguments is None or not self._accepts(name, arguments):
            return self._malformed()
        self._take(region_end)
        self._scanner = None
        self._call(name, arguments)
        return True

    def _malformed(self) -> bool:
        # The start tag becomes content; what follows is scanned again as text.
        self._scanner = None
        self._content(START)
        return True


class HermesParser(ToolParser):
    name = "hermes"
    stream_class = HermesStream
    markers = (START, END)
