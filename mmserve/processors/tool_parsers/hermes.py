"""Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of times, with text around. Used by Qwen2.5, Qwen3, Hermes 2/3 and others. The end
tag may be missing at the end of the output (cut by eos). Untagged calls: untagged.py.

A malformed call leaves its start tag as content, and the text after the tag is read again
for calls (a call cut short does not swallow the good ones after it); scan.py says why this
stays linear.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .base import ToolParser, json_call
from .scan import BalancedScanner, Scan
from .untagged import UntaggedFirst

START, END = "<tool_call>", "</tool_call>"


class HermesStream(UntaggedFirst):
    _scanner = BalancedScanner(0)  # the JSON of the call being read

    def _format(self) -> bool:
        at = self._content_until(START, START)
        if at is None:
            return False
        self._in.pos = at + len(START)  # `keep` stays at the tag: content if malformed
        self._scanner = BalancedScanner(self._in.pos, opening="{")
        self._state = self._value
        return True

    def _value(self) -> bool:
        state = self._scan(self._scanner)
        if state is None:
            return False
        if state is not Scan.END:
            return self._malformed()
        self._in.pos = self._scanner.pos
        self._state = self._end_tag
        return True

    def _end_tag(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            # Only whitespace after the JSON so far; at the end, the end tag is missing.
            return self._complete(reader.pos) if reader.final else False
        tag = reader.starts(END)
        if tag is None:
            return False
        return self._complete(reader.pos + len(END)) if tag else self._malformed()

    def _complete(self, region_end: int) -> bool:
        call = json_call(self._json_of(self._scanner))
        if call is None or not self._accepts(*call):
            return self._malformed()
        self._in.pos = self._in.keep = region_end
        self._call(*call)
        self._state = self._format
        return True

    def _malformed(self) -> bool:
        # The start tag becomes content; what follows it is read again as text.
        self._emit_to(self._in.keep + len(START))
        self._state = self._format
        return True


class HermesParser(ToolParser):
    name = "hermes"
    stream_class = HermesStream
    markers = (START, END)

    def call_tags(self, tools: Sequence[tuple[str, Any]]) -> dict[str, Any] | None:
        """A call as Qwen's templates ask for it, `<tool_call>\n{"name": "f", "arguments":
        {...}}\n</tool_call>`: the tag's begin holds the name, its content the arguments."""
        tags = [
            {"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": schema}, "end": f"}}\n{END}"}
            for name, schema in tools
        ]  # fmt: skip
        return {"type": "triggered_tags", "triggers": [START], "tags": tags}
