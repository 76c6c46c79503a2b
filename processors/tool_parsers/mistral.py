"""Mistral format: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (a JSON array, or
one object), with text around. Calls of one array are emitted together when it closes. A
malformed call leaves its marker as content and the text after it is read again for calls.
Untagged calls: untagged.py.

Mistral's chat templates require tool call ids of 9 letters and digits, so that is what
this parser generates (an id the model wrote into the call is kept if it has that form).
"""

from __future__ import annotations

import re
import secrets
import string
from typing import Any

from .base import ToolParser, json_call
from .scan import BalancedScanner, Scan
from .untagged import UntaggedFirst

START = "[TOOL_CALLS]"
_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(9))


class MistralStream(UntaggedFirst):
    _scanner = BalancedScanner(0)  # the JSON being read

    def _format(self) -> bool:
        at = self._content_until(START, START)
        if at is None:
            return False
        self._in.pos = at + len(START)  # `keep` stays at the marker: content if malformed
        self._scanner = BalancedScanner(self._in.pos)
        self._state = self._array
        return True

    def _array(self) -> bool:
        reader = self._in
        state = self._scan(self._scanner)
        if state is None:
            return False
        calls = _calls(self._json_of(self._scanner)) if state is Scan.END else None
        if calls is None or not all(self._accepts(n, a) for n, a, _ in calls):
            return self._malformed()
        reader.pos = reader.keep = self._scanner.pos
        for name, arguments, call_id in calls:
            self._call(name, arguments, call_id)
        self._state = self._format
        return True

    def _malformed(self) -> bool:
        # The marker becomes content; what follows it is read again as text.
        self._emit_to(self._in.keep + len(START))
        self._state = self._format
        return True


def _calls(value: Any) -> list[tuple[str, str, str | None]] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    if not calls or None in calls:
        return None
    return calls  # type: ignore[return-value]  # no None in it


def _call(item: Any) -> tuple[str, str, str | None] | None:
    call = json_call(item)
    if call is None:
        return None
    call_id = item.get("id")
    return (*call, call_id if isinstance(call_id, str) and _ID.fullmatch(call_id) else None)


class MistralParser(ToolParser):
    name = "mistral"
    stream_class = MistralStream
    markers = (START,)

    @staticmethod
    def default_id() -> str:
        return mistral_call_id()
