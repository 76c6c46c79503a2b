"""Where a bracketed value (a JSON object or array, a Python list) ends, found incrementally.

Only strings and bracket depth are tracked: enough to find the end of a well-formed value
in text that is still arriving; whether it is well formed is for json/ast to say after.

JSON is scanned strictly: outside strings, a character that JSON never has there (a letter
of no literal, `<`, a backslash) ends the scan as BAD on the spot. Besides failing early,
this is what keeps the formats linear. A scan that starts at a marker such as `<tool_call>`
can only run past a later marker while inside a string; a scan started at that later marker
is outside a string where the first is inside, so at the next marker one of the two is
outside a string and stops. At most two scans ever cover one character, however many
markers a malformed output repeats.
"""

from __future__ import annotations

import re
from enum import Enum

_WS = re.compile(r"\s*")
# Runs of what may stand outside strings and brackets: JSON (whitespace, separators, numbers,
# the letters of true/false/null), and Python (anything but quotes and brackets).
_JSON_OUTSIDE = re.compile(r"[ \t\n\r,:0-9.eE+\-aeflnrstu]*")
_PYTHON_OUTSIDE = re.compile(r"[^\"'()\[\]{}]*")
IN_STRING = {'"': re.compile(r'[^"\\]*'), "'": re.compile(r"[^'\\]*")}
_OPEN = "[{("
_CLOSE = "]})"


class Scan(Enum):
    NEED_MORE = "need_more"  # the value has not ended yet
    END = "end"  # it ended: `pos` is just past it
    BAD = "bad"  # not a value: `pos` is at the first character that cannot be in one


class BalancedScanner:
    """Scans for one bracketed value from absolute offset `pos`, after optional whitespace,
    the text arriving in pieces (`scan` resumes where it stopped: a value arriving in n
    deltas costs O(its length), not O(n * length))."""

    def __init__(self, pos: int, opening: str = "[{", python: bool = False) -> None:
        self.pos = pos  # absolute offset of the next character to read
        self.start = -1  # absolute offset of the opening bracket, once seen
        self.opening = opening  # brackets the value may start with
        self._quotes = "\"'" if python else '"'
        self._outside = _PYTHON_OUTSIDE if python else _JSON_OUTSIDE
        self._brackets = _OPEN if python else "[{"
        self._closing = _CLOSE if python else "]}"
        self._depth = 0
        self._quote = ""  # the delimiter of the string we are in, "" outside strings
        self._escape = False  # the previous character was a backslash in a string

    def scan(self, text: str, i: int) -> Scan:
        """Reads text[i:], the next piece of the value's text."""
        start, n = i, len(text)
        state = Scan.NEED_MORE
        while i < n:
            if self._escape:
                self._escape = False
                i += 1
            elif self._quote:
                i = IN_STRING[self._quote].match(text, i).end()  # type: ignore[union-attr]
                if i < n:
                    self._escape = text[i] == "\\"
                    self._quote = self._quote if self._escape else ""
                    i += 1
            elif self._depth == 0:
                i = _WS.match(text, i).end()  # type: ignore[union-attr]  # always matches
                if i < n:
                    if text[i] not in self.opening:
                        state = Scan.BAD
                        break
                    self.start, self._depth = self.pos + i - start, 1
                    i += 1
            else:
                i = self._outside.match(text, i).end()  # type: ignore[union-attr]
                if i < n:
                    state = self._structural(text[i])
                    if state is Scan.BAD:
                        break
                    i += 1
                    if state is Scan.END:
                        break
        self.pos += i - start
        return state

    def _structural(self, c: str) -> Scan:
        if c in self._quotes:
            self._quote = c
        elif c in self._brackets:
            self._depth += 1
        elif c in self._closing:
            self._depth -= 1
            if self._depth == 0:
                return Scan.END
        else:
            return Scan.BAD
        return Scan.NEED_MORE
