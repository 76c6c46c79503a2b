"""Llama 3.1 / 3.2 JSON format: the whole output is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several calls separated by `;`.

Only an output that *starts* (after whitespace) with `{` or `<|python_tag|>` can hold
calls; anything else is plain content. A call needs "name" and "parameters" (or
"arguments"), so a JSON answer that is not a call stays content. Untagged calls:
untagged.py (here: an array of calls, or a fenced call).
"""

from __future__ import annotations

from .base import ToolParser, json_call
from .scan import BalancedScanner, Scan
from .untagged import UntaggedFirst

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStream(UntaggedFirst):
    untagged_open = "["  # a bare object is the format's own call
    _scanner = BalancedScanner(0)  # the object being read

    def _format(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            return self._all_content() if reader.final else False
        tag = True if reader.peek(1) == "{" else reader.starts(PYTHON_TAG)
        if tag is None:
            return False
        if not tag:
            return self._all_content()
        if reader.peek(1) != "{":
            reader.pos += len(PYTHON_TAG)
        return self._object_at(reader.pos)

    def _object_at(self, pos: int) -> bool:
        self._scanner = BalancedScanner(pos, opening="{")
        self._state = self._object
        return True

    def _object(self) -> bool:
        reader, scanner = self._in, self._scanner
        state = self._scan(scanner)
        if state is None:
            return False
        call = json_call(self._json_of(scanner), need_arguments=True) if state is Scan.END else None
        if call is None or not self._accepts(*call):  # malformed: this and the rest is content
            return self._all_content()
        reader.pos = reader.keep = scanner.pos
        self._call(*call)
        self._state = self._separator
        return True

    def _separator(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            return self._all_content() if reader.final else False
        if reader.peek(1) != ";":
            return self._all_content()
        return self._object_at(reader.pos + 1)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    stream_class = Llama3JsonStream
    markers = (PYTHON_TAG,)
