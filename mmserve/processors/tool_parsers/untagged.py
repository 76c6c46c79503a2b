"""Untagged calls (base.py's contract): an output that is, after whitespace and one code
fence, one call object `{"name": ..., "arguments": {...}}` or a JSON array of them, all
accepted. Small models (a 0.5B Qwen2.5 coder, asked with one tool) answer like this,
without the format's markers.

This is read before the format, and only where there is an `accept` (the request has
tools, so a call names one of them). If the output turns out to be anything else, the
format reads it from its start (the text was only held, never given out), so the result is
exactly the format's own.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

from .base import Accept, StreamingToolParser, json_call, random_call_id
from .scan import BalancedScanner, Scan

FENCE = "```"
_LANGUAGE = "json"  # the one language tag a fenced call may have (or none)


class UntaggedFirst(StreamingToolParser):
    """A format whose output may also be untagged calls: subclasses give `_format`, the
    format's first state."""

    # What an output of bare untagged calls may start with (a fenced one: "{" or "[").
    untagged_open: ClassVar[str] = "{["

    def __init__(
        self, new_id: Callable[[], str] = random_call_id, accept: Accept | None = None
    ) -> None:
        super().__init__(new_id, accept)
        self._fenced = False  # inside the opening fence, not past a closing one
        self._lead_scanner = BalancedScanner(0)
        self._lead_calls: list[tuple[str, str]] = []

    @abc.abstractmethod
    def _format(self) -> bool:
        """The format's first state (reading from the start of the output)."""

    def _start(self) -> bool:
        self._state = self._lead if self._accept is not None else self._format
        return True

    def _lead(self) -> bool:
        """Up to the first character that is not whitespace."""
        reader = self._in
        if not reader.skip_ws():
            return self._lead_release() if reader.final else False
        head = reader.peek(1)
        if head in self.untagged_open:
            return self._lead_value()
        fence = reader.starts(FENCE) if head == "`" else False
        if fence is None:
            return False
        if not fence:
            return self._lead_release()
        reader.pos += len(FENCE)
        self._fenced = True
        self._state = self._lead_language
        return True

    def _lead_language(self) -> bool:
        """After the opening fence: an optional language tag, `json`."""
        reader = self._in
        head = reader.peek(len(_LANGUAGE)).lower()
        if head != _LANGUAGE and _LANGUAGE.startswith(head) and not reader.final:
            return False
        if head == _LANGUAGE:
            reader.pos += len(_LANGUAGE)
        self._state = self._lead_fenced
        return True

    def _lead_fenced(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            return self._lead_release() if reader.final else False
        return self._lead_value() if reader.peek(1) in ("{", "[") else self._lead_release()

    def _lead_value(self) -> bool:
        self._lead_scanner = BalancedScanner(self._in.pos)
        self._state = self._lead_value_end
        return True

    def _lead_value_end(self) -> bool:
        reader, scanner = self._in, self._lead_scanner
        state = self._scan(scanner)
        if state is None:
            return False
        if state is not Scan.END:
            return self._lead_release()
        calls = untagged_calls(self._json_of(scanner))
        if not calls or not all(self._accepts(*call) for call in calls):
            return self._lead_release()
        self._lead_calls, reader.pos = calls, scanner.pos
        self._state = self._lead_after
        return True

    def _lead_after(self) -> bool:
        """After the calls only whitespace and the closing fence may come."""
        reader = self._in
        if not reader.skip_ws():
            if not reader.final:
                return False
            if self._fenced:  # the fence was not closed
                return self._lead_release()
            for call in self._lead_calls:
                self._call(*call)
            reader.keep = reader.pos
            self._state = self._idle
            return True
        fence = reader.starts(FENCE) if self._fenced else False
        if fence is None:
            return False
        if not fence:
            return self._lead_release()
        reader.pos += len(FENCE)
        self._fenced = False
        return True

    def _lead_release(self) -> bool:
        """Not untagged calls: the format reads the output from its start."""
        self._in.pos = self._in.keep  # still 0: nothing was given out
        self._state = self._format
        return True


def untagged_calls(value: Any) -> list[tuple[str, str]] | None:
    """[(name, arguments)] of a call object or a non-empty array of them, else None."""
    items = value if isinstance(value, list) else [value]
    calls = [json_call(item, need_arguments=True) for item in items]
    if not calls or None in calls:
        return None
    return calls  # type: ignore[return-value]  # no None in it
