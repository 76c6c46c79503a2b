"""Mistral format, with text around the calls, in either of its generations:
- up to tokenizer v7: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (a JSON array,
  or one object); the calls of one array are emitted together when it closes;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): `[TOOL_CALLS]name{...}` per call,
  the name and arguments optionally split by `[ARGS]` and preceded by `[CALL_ID]id` where
  the tokenizer has those tokens: `[TOOL_CALLS]a[ARGS]{...}[TOOL_CALLS]b[ARGS]{...}`.
A malformed call leaves its marker as content and the text after it is read again for
calls. Untagged calls: untagged.py.

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

START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID = re.compile(r"[A-Za-z0-9]{9}")
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")  # a v11 function name
_CALL_ID = re.compile(r"[A-Za-z0-9]*")
_MAX_NAME = 64  # OpenAI's limit on function names; also bounds what is held to tell
_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(9))


class MistralStream(UntaggedFirst):
    _scanner = BalancedScanner(0)  # the JSON being read
    _name = ""  # v11: the function name read
    _call_id: str | None = None  # v11: the id after [CALL_ID]

    def _format(self) -> bool:
        at = self._content_until(START, START)
        if at is None:
            return False
        self._in.pos = at + len(START)  # `keep` stays at the marker: content if malformed
        self._state = self._after_marker
        return True

    def _after_marker(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            return self._malformed() if reader.final else False
        if reader.peek(1) in ("[", "{"):
            self._scanner = BalancedScanner(reader.pos)
            self._state = self._array
            return True
        self._name, self._call_id = "", None
        self._state = self._function_name
        return True

    def _array(self) -> bool:
        state = self._scan(self._scanner)
        if state is None:
            return False
        return self._emit(_calls(self._json_of(self._scanner)) if state is Scan.END else None)

    def _function_name(self) -> bool:
        word = self._word(_NAME)
        if word is None:
            return False
        if not word:
            return self._malformed()
        self._name = word
        self._state = self._id_marker
        return True

    def _id_marker(self) -> bool:
        marker = self._in.starts(CALL_ID)
        if marker is None:
            return False
        if marker:
            self._in.pos += len(CALL_ID)
        self._state = self._call_id_word if marker else self._args_marker
        return True

    def _call_id_word(self) -> bool:
        word = self._word(_CALL_ID)
        if word is None:
            return False
        self._call_id = word if _ID.fullmatch(word) else None
        self._state = self._args_marker
        return True

    def _args_marker(self) -> bool:
        reader = self._in
        marker = reader.starts(ARGS)
        if marker is None:
            return False
        if marker:
            reader.pos += len(ARGS)
        self._scanner = BalancedScanner(reader.pos, opening="{")
        self._state = self._arguments
        return True

    def _arguments(self) -> bool:
        state = self._scan(self._scanner)
        if state is None:
            return False
        if state is not Scan.END:
            return self._malformed()
        arguments = self._json_of(self._scanner)
        call = _call({"name": self._name, "arguments": arguments}, self._call_id)
        return self._emit(None if call is None else [call])

    def _emit(self, calls: list[tuple[str, str, str | None]] | None) -> bool:
        """The calls the scanned value holds, if they all are calls; else it is malformed."""
        if calls is None or not all(self._accepts(n, a) for n, a, _ in calls):
            return self._malformed()
        self._in.pos = self._in.keep = self._scanner.pos
        for name, arguments, call_id in calls:
            self._call(name, arguments, call_id)
        self._state = self._format
        return True

    def _word(self, pattern: re.Pattern[str]) -> str | None:
        """The run of `pattern` at the cursor (consumed), "" if none or too long for a name;
        None while it may go on."""
        reader = self._in
        head = reader.peek(_MAX_NAME + 1)
        n = pattern.match(head).end()  # type: ignore[union-attr]  # `*` always matches
        if n > _MAX_NAME:
            return ""
        if n == len(head) and not reader.final:
            return None
        reader.pos += n
        return head[:n]

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


def _call(item: Any, call_id: Any = None) -> tuple[str, str, str | None] | None:
    call = json_call(item)
    if call is None:
        return None
    if isinstance(item, dict) and call_id is None:
        call_id = item.get("id")
    return (*call, call_id if isinstance(call_id, str) and _ID.fullmatch(call_id) else None)


class MistralParser(ToolParser):
    name = "mistral"
    stream_class = MistralStream
    markers = (START, ARGS, CALL_ID)

    @staticmethod
    def default_id() -> str:
        return mistral_call_id()
