"""Llama 3.1 / 3.2 JSON format: a call is a JSON object `{"name": ..., "parameters": {...}}`
("arguments" also), optionally after `<|python_tag|>`. The model may write prose before,
between and after calls, and separate calls by `;`, newlines or repeated tags (whitespace
and one `;` between two calls are dropped). Untagged calls: untagged.py (here: an array of
calls, or a fenced call).

A call needs "name" and "parameters" (or "arguments"), so a JSON answer that is not a call
stays content. A `{` that does not start a call makes the whole value it starts content:
the search for calls goes on after that value, not inside it. So a JSON answer with a
call-shaped part is not a call, and no character is read more than twice.
"""

from __future__ import annotations

import re

from .base import ToolParser, json_call
from .scan import BalancedScanner, Scan
from .untagged import UntaggedFirst

PYTHON_TAG = "<|python_tag|>"
_CANDIDATE = re.compile(r"\{|" + re.escape(PYTHON_TAG))


class Llama3JsonStream(UntaggedFirst):
    untagged_open = "["  # a bare object is the format's own call
    _scanner = BalancedScanner(0)  # the object being read
    _semicolon = False  # the separator after the last call has had its `;`

    def _format(self) -> bool:
        if self._content_until(_CANDIDATE, PYTHON_TAG) is None:
            return False
        return self._begin()

    def _begin(self) -> bool:
        """At `{` or at the tag; `keep` is where content resumes if this is not a call."""
        reader = self._in
        if reader.peek(1) == "{":
            self._scanner = BalancedScanner(reader.pos, opening="{")
            self._state = self._object
        else:
            reader.pos += len(PYTHON_TAG)
            self._state = self._after_tag
        return True

    def _after_tag(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            return self._not_call(reader.pos) if reader.final else False
        if reader.peek(1) != "{":
            return self._not_call(reader.pos)
        self._scanner = BalancedScanner(reader.pos, opening="{")
        self._state = self._object
        return True

    def _object(self) -> bool:
        reader, scanner = self._in, self._scanner
        state = self._scan(scanner)
        if state is None:
            return False
        if state is not Scan.END:  # content up to the fault (or the end)
            return self._not_call(scanner.pos)
        call = json_call(self._json_of(scanner), need_arguments=True)
        if call is None or not self._accepts(*call):
            return self._not_call(scanner.pos)
        reader.pos = reader.keep = scanner.pos
        self._call(*call)
        self._semicolon = False
        self._state = self._separator
        return True

    def _separator(self) -> bool:
        """After a call: whitespace, then one `;` and whitespace, may come before the next."""
        reader = self._in
        if not reader.skip_ws():
            return self._not_call(reader.pos) if reader.final else False
        head = reader.peek(1)
        if head == ";" and not self._semicolon:
            reader.pos += 1
            self._semicolon = True
            return True
        tag = True if head == "{" else reader.starts(PYTHON_TAG)
        if tag is None:
            return False
        return self._begin() if tag else self._not_call(reader.pos)

    def _not_call(self, resume: int) -> bool:
        """Everything held (a separator, a tag, a value that is not a call) is content up
        to `resume`, where the search for calls goes on."""
        self._emit_to(resume)
        self._state = self._format
        return True


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    stream_class = Llama3JsonStream
    markers = (PYTHON_TAG,)
