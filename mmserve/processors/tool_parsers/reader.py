"""The text of one output as it streams in, read through a cursor, in time linear in its
length however it is chunked.

Appending a chunk is O(its length): chunks are joined only by `window()`, which a parser
calls where little text is held back (plain content, a few characters that may start a
marker) and once when it decides a region it held (a call, or what turns out not to be
one). While it holds a long region undecided (a JSON value arriving a token at a time, a
run of whitespace), it reads only the new chunks (`pieces`, `scan`, `skip_ws`, `peek`), so
the held text is not copied again on every delta. Reads take an index into a string and
never slice off its rest, so a one-shot parse (one chunk of any length) copies nothing.
"""

from __future__ import annotations

import re
from typing import Protocol

from .scan import Scan

_WS = re.compile(r"\s*")
_BLOCK = 64  # chunks appended are joined in blocks of this many (fewer, larger strings)


class Scanner(Protocol):
    pos: int  # absolute offset of the next character it will read

    def scan(self, text: str, i: int) -> Scan:
        """Reads text[i:], advancing pos; stops at the end of the value or at a fault."""
        ...


class Reader:
    def __init__(self) -> None:
        self._text = ""  # joined text, from absolute offset _base on
        self._base = 0
        self._more: list[str] = []  # chunks appended after _text, not joined yet
        self._loose = 0  # how many of the last chunks of _more are not joined into a block
        self.end = 0  # absolute length of everything appended
        self.pos = 0  # the cursor: absolute offset of the next character to read
        self.keep = 0  # text before this offset is never read again (and may be dropped)
        self.final = False  # nothing more will be appended

    def append(self, chunk: str) -> None:
        if chunk:
            self._more.append(chunk)
            self.end += len(chunk)
            self._loose += 1
            if self._loose == _BLOCK:  # a region held for long: bound the number of strings
                self._more[-_BLOCK:] = ["".join(self._more[-_BLOCK:])]
                self._loose = 0

    def window(self) -> tuple[str, int]:
        """(text, offset): one string holding the text from `keep` to the end, where text[i]
        is at absolute offset + i. Joins what came since the last call: O(end - keep)."""
        if self._more:
            joined = "".join([self._text[self.keep - self._base :], *self._more])
            # `keep` may lie in the chunks not joined yet (a state read past a marker with
            # peek and moved `keep` beyond it): the text before it is not part of the window.
            past = self.keep - self._base - len(self._text)
            self._text = joined[past:] if past > 0 else joined
            self._base, self._more, self._loose = self.keep, [], 0
        return self._text, self._base

    def text(self, start: int, stop: int) -> str:
        text, base = self.window()
        return text[start - base : stop - base]

    def pieces(self, start: int) -> list[tuple[str, int]]:
        """The text from absolute `start` to the end as (string, index) pairs, in order,
        without joining: O(number of chunks after start)."""
        out = []
        at = self.end
        for chunk in reversed(self._more):
            if at <= start:
                break
            at -= len(chunk)
            out.append((chunk, max(start - at, 0)))
        if at > start:
            out.append((self._text, start - self._base))
        out.reverse()
        return out

    def scan(self, scanner: Scanner) -> Scan:
        """Feeds the scanner what arrived after its position."""
        for text, i in self.pieces(scanner.pos):
            state = scanner.scan(text, i)
            if state is not Scan.NEED_MORE:
                return state
        return Scan.NEED_MORE

    def skip_ws(self) -> bool:
        """Moves the cursor past whitespace: True when a character other than whitespace
        is at the cursor, False when the text so far ends in whitespace."""
        for text, i in self.pieces(self.pos):
            j = _WS.match(text, i).end()  # type: ignore[union-attr]  # \s* always matches
            self.pos += j - i
            if j < len(text):
                return True
        return False

    def peek(self, n: int) -> str:
        """Up to n characters from the cursor (fewer where the text so far ends)."""
        parts: list[str] = []
        for text, i in self.pieces(self.pos):
            parts.append(text[i : i + n])
            n -= len(parts[-1])
            if n <= 0:
                break
        return "".join(parts)

    def starts(self, s: str) -> bool | None:
        """Whether the text at the cursor starts with s; None while it may but too little
        has arrived to tell."""
        head = self.peek(len(s))
        if head == s:
            return True
        return None if s.startswith(head) and not self.final else False

    def at_end(self) -> bool:
        return self.pos >= self.end
