"""Mistral format: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (a JSON array, or
one object), with text around. Calls of one array are emitted together when it closes.

Mistral's chat templates require tool call ids of 9 letters and digits, so that is what
this parser generates (an id the model wrote into the call is kept if it has that form).
"""

from __future__ import annotations

import re
import secrets
import string
from typing import Any

from .base import (
    StreamingToolParser,
    ToolParser,
    arguments_of,
    canonical_arguments,
    loads_json,
)
from .scan import BalancedScanner, Scan

START = "[TOOL_CALLS]"
_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(9))


class MistralStream(StreamingToolParser):
    _scanner: BalancedScanner | None = None  # set after [TOOL_CALLS]

    def _step(self) -> bool:
        return self._text() if self._scanner is None else self._inside()

    def _text(self) -> bool:
        if not self._content_until(START):
            return False
        self._scanner = BalancedScanner(opening="[{")
        return True

    def _inside(self) -> bool:
        assert self._scanner is not None
        state = self._scanner.scan(self._buf)
        if state is Scan.NEED_MORE and not self._final:
            return False
        calls = _calls(self._buf[: self._scanner.pos]) if state is Scan.END else None
        if calls is None or not all(self._accepts(n, a) for n, a, _ in calls):
            # malformed: the marker is content, the rest is text again
            self._scanner = None
            self._content(START)
            return True
        self._take(self._scanner.pos)
        self._scanner = None
        for name, arguments, call_id in calls:
            self._call(name, arguments, call_id)
        return True


def _calls(text: str) -> list[tuple[str, str, str | None]] | None:
    try:
        value = loads_json(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _call(item: Any) -> tuple[str, str, str | None] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = canonical_arguments(arguments_of(item))
    if arguments is None:
        return None
    call_id = item.get("id")
    return (
        item["name"],
        arguments,
        call_id if isinstance(call_id, str) and _ID.fullmatch(call_id) else None,
    )


class MistralParser(ToolParser):
    name = "mistral"
    stream_class = MistralStream
    markers = (START,)

    @staticmethod
    def default_id() -> str:
        return mistral_call_id()
