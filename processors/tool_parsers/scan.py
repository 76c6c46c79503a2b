"""Where a bracketed value (a JSON object or array, a Python list) ends, found incrementally.

Only strings and bracket depth are tracked: enough to find the end of a well-formed value
in text that is still arriving; whether it is well formed is for json/ast to say after.
"""

from __future__ import annotations

from enum import Enum

_OPEN = "[{("
_CLOSE = "]})"


class Scan(Enum):
    NEED_MORE = "need_more"  # the value has not ended yet
    END = "end"  # it ended: `BalancedScanner.pos` is just past it
    BAD = "bad"  # not a value (no opening bracket) or the abort marker came first


class BalancedScanner:
    """Scans text[0:] for one bracketed value, after optional whitespace.

    The text may grow between calls (same prefix); scanning resumes where it stopped, so a
    value arriving in n deltas costs O(its length), not O(n * length).
    """

    def __init__(self, quotes: str = '"', opening: str = _OPEN, abort: str | None = None) -> None:
        self.quotes = quotes  # string delimiters: '"' for JSON, "\"'" for Python
        self.opening = opening  # brackets the value may start with
        self.abort = abort  # a marker that cannot occur outside strings in a valid value
        self.pos = 0  # next index of the text to look at
        self._depth = 0
        self._quote = ""  # the delimiter of the string we are in, "" outside strings
        self._escape = False
        self._ended = False

    def scan(self, text: str) -> Scan:
        if self._ended:  # asked again while the caller waits for what follows the value
            return Scan.END
        while self.pos < len(text):
            c = text[self.pos]
            if self._quote:
                self._in_string(c)
            elif self._depth == 0:
                if not c.isspace():
                    if c not in self.opening:
                        return Scan.BAD
                    self._depth = 1
            elif self.abort is not None and c == self.abort[0]:
                if text.startswith(self.abort, self.pos):
                    return Scan.BAD
                if self.abort.startswith(text[self.pos :]):
                    return Scan.NEED_MORE  # may be the marker: decide on more text
            elif c in self.quotes:
                self._quote = c
            elif c in _OPEN:
                self._depth += 1
            elif c in _CLOSE:
                self._depth -= 1
                if self._depth == 0:
                    self.pos += 1
                    self._ended = True
                    return Scan.END
            self.pos += 1
        return Scan.NEED_MORE

    def _in_string(self, c: str) -> None:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == self._quote:
            self._quote = ""
