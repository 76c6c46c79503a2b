"""Llama 3.1 / 3.2 JSON format: the whole output is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several calls separated by `;`.

Only an output that *starts* (after whitespace) with `{` or `<|python_tag|>` can hold
calls; anything else is plain content. A call needs "name" and "parameters" (or
"arguments"), so a JSON answer that is not a call stays content.
"""

from __future__ import annotations

from .base import StreamingToolParser, ToolParser, canonical_arguments, loads_json
from .scan import BalancedScanner, Scan

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStream(StreamingToolParser):
    _state = "start"  # start -> calls (-> separator -> calls)* -> text
    _scanner: BalancedScanner | None = None
    _prefix = ""  # what was consumed of an undecided call: content if it turns out malformed

    def _step(self) -> bool:
        if self._state == "text":
            self._content(self._take(len(self._buf)))
            return False
        return {"start": self._start, "calls": self._object, "separator": self._separator}[
            self._state
        ]()

    def _start(self) -> bool:
        rest = self._buf.lstrip()
        if not self._final and (not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG)):
            return False  # only whitespace, or perhaps the start of the tag: wait
        gap = len(self._buf) - len(rest)
        if rest.startswith(PYTHON_TAG):
            self._prefix = self._take(gap + len(PYTHON_TAG))
        elif rest.startswith("{"):
            self._prefix = self._take(gap)
        else:
            self._state = "text"
            return True
        self._begin_object()
        return True

    def _begin_object(self) -> None:
        self._state = "calls"
        self._scanner = BalancedScanner(opening="{")

    def _object(self) -> bool:
        assert self._scanner is not None
        state = self._scanner.scan(self._buf)
        if state is Scan.NEED_MORE and not self._final:
            return False
        call = _call(self._buf[: self._scanner.pos]) if state is Scan.END else None
        if call is None or not self._accepts(*call):  # malformed: this and the rest is content
            self._content(self._prefix)
            self._state = "text"
            return True
        self._take(self._scanner.pos)
        self._call(*call)
        self._state, self._prefix = "separator", ""
        return True

    def _separator(self) -> bool:
        rest = self._buf.lstrip()
        if not rest:
            return False  # only whitespace so far (dropped at the end: it follows a call)
        if rest.startswith(";"):
            self._prefix = self._take(len(self._buf) - len(rest) + 1)
            self._begin_object()
        else:
            self._state = "text"
        return True


def _call(text: str) -> tuple[str, str] | None:
    try:
        value = loads_json(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "parameters" if "parameters" in value else "arguments"
    arguments = canonical_arguments(value.get(key)) if value["name"] else None
    return None if arguments is None else (value["name"], arguments)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    stream_class = Llama3JsonStream
    markers = (PYTHON_TAG,)
