"""Reject regex features that a grammar engine would silently change, before compiling.

Both engines match a regex against the *whole* output, so a leading `^` and a trailing `$`
mean nothing and are dropped. What must be refused, because an engine ignores it instead
of failing (found by experiment with xgrammar 0.2.9 and outlines-core 0.2.14):
- lookahead `(?=...)` / `(?!...)` in JSON-schema patterns (xgrammar drops it with a log line)
- `^` / `$` anywhere but the ends (xgrammar drops them, so `a$b` would match "ab")
- escapes with a letter it does not know (xgrammar matches `\\A` as the letter "A")
Everything else that the engines cannot do (backreferences, lookbehind, \\b, \\p{...}) makes
them fail, and that error is reported as it is. Plain syntax errors (an unclosed group,
nothing to repeat, a reversed range) are found here too, with Python's parser (close to
ECMA-262's for these), so that they are blamed on the field that holds the pattern.
"""

from __future__ import annotations

import re
import warnings

# Letter escapes with the same meaning in ECMA-262, Python and both engines.
_CLASS_ESCAPES = frozenset("dDwWsS")
_CONTROL_ESCAPES = frozenset("ntrfv")
_HEX_ESCAPES = {"x": 2, "u": 4}  # \xHH, \uHHHH
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


class RegexProblem(ValueError):
    """A feature an engine would ignore; `position` indexes the original pattern."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(f"at position {position}: {message}")
        self.position = position


def strip_anchors(pattern: str) -> str:
    """Check `pattern` and return it without a leading `^` / trailing `$` (see module doc).

    Raises RegexProblem naming the first feature that an engine would ignore.
    """
    _scan(pattern)
    _check_syntax(pattern)
    start = 1 if pattern.startswith("^") else 0
    end = len(pattern) - 1 if ends_with_anchor(pattern) else len(pattern)
    return pattern[start:end]


def _check_syntax(pattern: str) -> None:
    """RegexProblem for a pattern that no regex engine reads; ECMA-262's named groups
    `(?<name>...)` are read as Python's `(?P<name>...)`."""
    python = re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", pattern)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FutureWarning on nested sets and the like
            re.compile(python)
    except re.error as e:
        position = e.pos or 0
        if python != pattern:  # map back past the inserted "P"s
            position -= python[:position].count("(?P<") - pattern[:position].count("(?P<")
        raise RegexProblem(max(position, 0), e.msg) from None
    except (RecursionError, OverflowError):
        raise RegexProblem(0, "too deeply nested or too large") from None


def ends_with_anchor(pattern: str) -> bool:
    if not pattern.endswith("$"):
        return False
    backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
    return backslashes % 2 == 0  # an odd count escapes the `$`


def _scan(pattern: str) -> None:
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i = _check_escape(pattern, i)
            continue
        if in_class:
            if c == "[":
                raise RegexProblem(i, "escape `[` inside a character class (`\\[`)")
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif pattern.startswith(_LOOKAROUND, i):
            raise RegexProblem(i, "lookaround assertions are not supported")
        elif c == "^" and i != 0:
            raise RegexProblem(i, "`^` is only allowed at the start (the whole output matches)")
        elif c == "$" and i != len(pattern) - 1:
            raise RegexProblem(i, "`$` is only allowed at the end (the whole output matches)")
        i += 1


def _check_escape(pattern: str, i: int) -> int:
    """Validate the escape at pattern[i] == '\\'; return the index after it."""
    if i + 1 >= len(pattern):
        raise RegexProblem(i, "the pattern ends with a lone backslash")
    c = pattern[i + 1]
    if c in _HEX_ESCAPES:
        digits = pattern[i + 2 : i + 2 + _HEX_ESCAPES[c]]
        if len(digits) != _HEX_ESCAPES[c] or not _is_hex(digits):
            raise RegexProblem(i, f"`\\{c}` needs {_HEX_ESCAPES[c]} hex digits")
        return i + 2 + _HEX_ESCAPES[c]
    if c.isascii() and c.isalnum() and c not in _CLASS_ESCAPES | _CONTROL_ESCAPES:
        raise RegexProblem(i, f"the escape `\\{c}` is not supported")
    return i + 2


def _is_hex(text: str) -> bool:
    return all(ch in "0123456789abcdefABCDEF" for ch in text)


# Code points that may not appear raw inside a JSON string: they end it (`"`), start an
# escape (`\`), or are control characters.
def _json_unsafe(lo: int, hi: int) -> bool:
    return lo < 0x20 or lo <= 0x22 <= hi or lo <= 0x5C <= hi


def check_json_string_pattern(pattern: str) -> None:
    """Refuse a pattern that could match `"`, `\\` or a control character.

    For engines that apply a schema's pattern to the raw JSON text between the quotes
    (outlines-core does): there such a match ends the string early or makes invalid JSON.
    Conservative: `.`, negated classes and class escapes are refused outright (outlines-core's
    \\d and \\w are also Unicode-aware, where ECMA-262's, which JSON Schema uses, are ASCII).
    """
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            i = _check_class(pattern, i)
            continue
        kind, value, end = _atom(pattern, i)
        if (kind == "meta" and value == ".") or kind == "class":
            raise RegexProblem(i, _UNSAFE_MESSAGE)
        if kind == "char" and _json_unsafe(ord(value), ord(value)):
            raise RegexProblem(i, _UNSAFE_MESSAGE)
        i = end


def json_special_literal(pattern: str) -> str | None:
    """The first `"`, `\\` or control character that `pattern` (a checked one) has as a
    literal or as a member of a class that is not negated; None if there is none.

    xgrammar 0.2.9 turns a schema pattern with such a character into grammar rules over the
    raw JSON text: `a"b` writes a bare quote, `\\\\` a bare backslash, `\\n` a raw newline
    (invalid JSON), and `.` beside them any character at all. Conservative: some classes
    with such a member (`[a"]`) it reads soundly, leaving the member out."""
    i = 0
    while i < len(pattern):
        found: list[int] = []
        if pattern[i] == "[":
            members, end = _class_members(pattern, i)
            if not pattern.startswith("[^", i):  # a range's ends, as written (not what is between)
                found = [c for _, lo, hi in members if lo >= 0 for c in (lo, hi)]
            i = end
        else:
            kind, value, i = _atom(pattern, i)
            found = [ord(value)] if kind == "char" else []
        for c in found:
            if _json_unsafe(c, c):
                return chr(c)
    return None


_UNSAFE_MESSAGE = (
    'may match `"`, `\\`, a control character (which this backend would put into the JSON '
    "text unescaped) or a non-ASCII digit or letter; list the allowed characters explicitly "
    "(e.g. [A-Za-z0-9_ ])"
)


def _check_class(pattern: str, start: int) -> int:
    """Check the class at pattern[start] == '['; return the index after its ']'."""
    if pattern.startswith("[^", start):
        raise RegexProblem(start, "a negated class " + _UNSAFE_MESSAGE)
    members, end = _class_members(pattern, start)
    for position, lo, hi in members:
        if lo < 0 or _json_unsafe(lo, hi):  # (a class escape: \d, \w, \s)
            raise RegexProblem(position, _UNSAFE_MESSAGE)
    return end


def _class_members(pattern: str, start: int) -> tuple[list[tuple[int, int, int]], int]:
    """The members of the class at pattern[start] == '[' (after a `^`) as (position, lowest,
    highest code point), (position, -1, -1) for a class escape; and the index after its ']'."""
    i = start + (2 if pattern.startswith("[^", start) else 1)
    members = []
    while i < len(pattern) and pattern[i] != "]":
        kind, value, i_next = _atom(pattern, i)
        if kind == "class":
            members.append((i, -1, -1))
            i = i_next
            continue
        lo = hi = ord(value)
        is_range = pattern.startswith("-", i_next) and pattern[i_next + 1 : i_next + 2] not in "]"
        if is_range:  # a-z; a "-" right before "]" is a literal
            _, upper, i_next = _atom(pattern, i_next + 1)
            hi = ord(upper)
        members.append((i, lo, hi))
        i = i_next
    return members, i + 1


def _atom(pattern: str, i: int) -> tuple[str, str, int]:
    """(kind, value, next index): kind is "char" (a literal), "class" (\\d-style escape,
    value = its letter) or "meta" (unescaped syntax character)."""
    c = pattern[i]
    if c != "\\":
        return ("meta" if c in ".()|*+?{}^$" else "char"), c, i + 1
    nxt = pattern[i + 1] if i + 1 < len(pattern) else "\\"
    if nxt in _HEX_ESCAPES:
        digits = pattern[i + 2 : i + 2 + _HEX_ESCAPES[nxt]]
        return "char", chr(int(digits, 16)) if _is_hex(digits) else "\0", i + 2 + len(digits)
    if nxt in _CONTROL_ESCAPES:
        return "char", "\n", i + 2  # any control character: all equally unsafe
    if nxt in _CLASS_ESCAPES:
        return "class", nxt, i + 2
    return "char", nxt, i + 2
