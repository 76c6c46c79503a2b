"""A schema's `pattern` as the engines need it.

Both engines match a pattern against the whole string, while JSON Schema reads a pattern as
a search. So a pattern is handed over as the whole strings it matches: without its anchors,
and with OPEN_END (any printable ASCII but `"` and `\\`, repeated) where an alternative has
none (`^https?://` is `https?://[ !#-\\[\\]-~]*`). That is a narrowing of the open ends to
what both engines write soundly: xgrammar 0.2.9 lets `.` and classes reaching past ASCII
write broken UTF-8 (a lead byte, then ASCII), and its raw-text patterns write `"` and `\\`
unescaped. Where a pattern's length bounds (minLength/maxLength) cannot be folded into that
form, rewrites.py narrows it to its whole-string matches (`^(?:...)$`), which are matches too:
nothing invalid is let through.

outlines-core puts the pattern into its regex for the raw JSON text between the quotes,
ungrouped (outlines-core 0.2.14: `"normal|italic"` becomes `"normal` or `italic"`).
`json_text_pattern` translates a pattern into one that is grouped and matches the JSON text
of the strings the pattern matches: `"` and `\\` become their escapes, control characters
and negated classes are left out or restricted to printable ASCII, \\d \\w \\s to their ASCII
members (jsonschema, like Python, reads them as Unicode classes: the ASCII ones are always
among them).
"""

from __future__ import annotations

import re
import re._parser as sre  # the width of a pattern; stable since Python 3.11
import warnings
from collections.abc import Iterator

from .regex_check import RegexProblem, ends_with_anchor, strip_anchors

_UNSAFE = '"\\'  # and every character below U+0020
_SAFE_CLASS = '[^"\\\\\\x00-\\x1f]'  # a JSON string character that needs no escape
_PRINTABLE = '[ !#-\\[\\]-~]'  # printable ASCII but `"` and `\`
OPEN_END = f"{_PRINTABLE}*"  # what an unanchored end of a pattern may add (module doc)
_CLASS_ESCAPES = {"d": "0-9", "w": "A-Za-z0-9_", "s": " "}
_NEGATED_ESCAPES = {"D": "[ -/:-~&&[^\"\\\\]]", "W": "[ -/:-@\\[-^`{-~&&[^\"\\\\]]", "S": "[!-~&&[^\"\\\\]]"}
_META = frozenset(".+*?()|[]{}^$#&-~")  # escaped in outlines-core's (Rust) syntax
_SYNTAX = frozenset("+*?)|{},0123456789")  # passed on as they are (repetitions, groups)
_ATOM_QUANT = re.compile(r"(\[(?:\\.|[^\]\\])+\]|\\[^xu]|\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|[^\\()|*+?{}\[\]^$])"
                         r"(\*|\+|\?|\{(\d+)(,(\d*))?\})?")  # fmt: skip


def full_match(pattern: str, search: bool = True) -> str:
    """The whole strings a schema pattern matches, as a regex without anchors: the anchors of
    its top-level alternatives (also inside a group that is a whole alternative, `^(a$|b)`)
    removed, and, with search, OPEN_END where an alternative lacks one (module doc); without
    search, the narrowing to its whole-string matches. RegexProblem for an anchor elsewhere,
    lookaround, unknown escapes and syntax errors."""
    return _without_anchors(pattern, 0, (not search, not search))


def whole_string(pattern: str) -> str:
    """The pattern narrowed to its whole-string matches, anchored (`a|b` -> `^(?:a|b)$`)."""
    body = full_match(pattern, search=False)
    return f"^{body}$" if len(_split_alternatives(body)) == 1 else f"^(?:{body})$"


def _without_anchors(pattern: str, offset: int, anchored: tuple[bool, bool]) -> str:
    """anchored: whether the enclosing alternative had its `^` and its `$`."""
    out, position = [], offset
    for alternative in _split_alternatives(pattern):
        start = 1 if alternative.startswith("^") else 0
        end = len(alternative) - 1 if ends_with_anchor(alternative[start:]) else len(alternative)
        body = alternative[start:end]
        ends = (anchored[0] or start == 1, anchored[1] or end < len(alternative))
        group = _whole_group(body)
        if group is not None:
            opening, inner = group
            body = f"(?:{_without_anchors(inner, position + start + opening, ends)})"
            ends = (True, True)  # the group's alternatives have theirs
        try:
            body = strip_anchors(body)
        except RegexProblem as e:
            raise RegexProblem(position + start + e.position, str(e).split(": ", 1)[1]) from None
        out.append(("" if ends[0] else OPEN_END) + body + ("" if ends[1] else OPEN_END))
        position += len(alternative) + 1
    return "|".join(out)


def _syntax(pattern: str) -> Iterator[tuple[int, str, int]]:
    """(index, character, group depth before it) of each character outside escapes and
    character classes."""
    depth, in_class, i = 0, False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        else:
            yield i, c, depth
            depth += {"(": 1, ")": -1}.get(c, 0)
        i += 1


def _whole_group(body: str) -> tuple[int, str] | None:
    """(length of its opening, its inside) if `body` is one group, else None."""
    opening = re.match(r"\((?:\?:|\?P?<[A-Za-z_][A-Za-z0-9_]*>)?", body)
    if opening is None or opening.group() in ("(?=", "(?!") or not body.endswith(")"):
        return None
    closes = [i for i, c, depth in _syntax(body) if c == ")" and depth == 1]
    return (opening.end(), body[opening.end() : -1]) if closes[:1] == [len(body) - 1] else None


def xgrammar_pattern(body: str) -> str:
    """A whole-string pattern (full_match's) as xgrammar 0.2.9 reads it right: in a schema's
    pattern it lets `(ab+)?` match "b" (an optional group whose inside repeats), not so
    `(ab+){0,1}`."""
    syntax = [(i, c) for i, c, _ in _syntax(body)]
    closes = {i for i, c in syntax if c == ")"}
    for i in reversed([i for i, c in syntax if c == "?" and i - 1 in closes]):
        body = body[:i] + "{0,1}" + body[i + 1 :]
    return body


def _split_alternatives(pattern: str) -> list[str]:
    cuts = [i for i, c, depth in _syntax(pattern) if c == "|" and depth == 0]
    bounds = zip([-1, *cuts], [*cuts, len(pattern)], strict=True)
    return [pattern[a + 1 : b] for a, b in bounds]


def length_range(pattern: str) -> tuple[int, int | None] | None:
    """(fewest, most or None) characters of a whole-string match; None if unknown."""
    try:
        body = full_match(pattern)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            low, high = sre.parse(re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", body)).getwidth()
    except (RegexProblem, re.error, RecursionError, OverflowError):
        return None
    return low, None if high >= sre.MAXREPEAT else high


def with_length(pattern: str, low: int, high: int | None) -> str | None:
    """A pattern of single-character atoms of which one repeats (`^[a-z]+$`,
    `^[A-Z][a-z0-9]*$`, `^https://` whose open end repeats) with the length bounds
    folded into that repetition, anchored; None for any other pattern, or if no length fits
    both."""
    try:
        body = full_match(pattern)
    except RegexProblem:
        return None
    atoms = list(_ATOM_QUANT.finditer(body))
    if not atoms or "".join(m.group() for m in atoms) != body:
        return None
    ranges = [_repeats(m) for m in atoms]
    varying = [i for i, (lo, hi) in enumerate(ranges) if lo != hi]
    if len(varying) != 1:
        return None
    fixed = sum(lo for i, (lo, _) in enumerate(ranges) if i != varying[0])
    lo, hi = ranges[varying[0]]
    lo = max(lo, low - fixed)
    hi = hi if high is None else (high - fixed if hi is None else min(hi, high - fixed))
    if hi is not None and lo > hi:
        return None
    atom = atoms[varying[0]]
    repeat = f"{atom.group(1)}{{{lo},{'' if hi is None else hi}}}"
    return f"^{body[: atom.start()]}{repeat}{body[atom.end() :]}$"  # anchored: a whole string


def _repeats(atom: re.Match[str]) -> tuple[int, int | None]:
    """How many times an atom of _ATOM_QUANT repeats: (fewest, most or None)."""
    quant, q_low, comma, q_high = atom.group(2, 3, 4, 5)
    fixed = {None: (1, 1), "*": (0, None), "+": (1, None), "?": (0, 1)}
    if quant in fixed:
        return fixed[quant]
    return int(q_low), int(q_high) if q_high else (None if comma else int(q_low))


def json_text_pattern(pattern: str) -> str:
    """A grouped regex over the raw JSON text of a string (module doc); RegexProblem if
    the pattern is not one an engine reads."""
    body = full_match(pattern)
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c == "[":
            text, i = _class(body, i)
            out.append(text)
        elif c == "\\":
            text, i = _escape(body, i)
            out.append(text)
        elif c == ".":
            out.append(_SAFE_CLASS)
            i += 1
        elif c == "(":
            i = _group(body, i, out)
        else:
            out.append(c if c in _SYNTAX else _literal(c))
            i += 1
    return f"(?:{''.join(out)})"


def _group(body: str, i: int, out: list[str]) -> int:
    """A group opening: named and non-capturing groups become `(?:`."""
    m = re.compile(r"\(\?(?::|P?<[A-Za-z_][A-Za-z0-9_]*>)").match(body, i)
    out.append("(?:" if m else "(")
    return m.end() if m else i + 1


def _literal(c: str) -> str:
    """The JSON text of one character, as a regex."""
    if c == '"':
        return '(?:\\\\")'
    if c == "\\":
        return "(?:\\\\\\\\)"
    if ord(c) < 0x20:
        escape = {"\n": "n", "\t": "t", "\r": "r"}.get(c, f"u{ord(c):04x}")
        return f"(?:\\\\{escape})"
    return "\\" + c if c in _META else c


def _escape(body: str, i: int) -> tuple[str, int]:
    nxt = body[i + 1]
    if nxt in _CLASS_ESCAPES:
        return f"[{_CLASS_ESCAPES[nxt]}]", i + 2
    if nxt in _NEGATED_ESCAPES:
        return _NEGATED_ESCAPES[nxt], i + 2
    char, end = _escaped_char(body, i)
    return _literal(char), end


def _escaped_char(body: str, i: int) -> tuple[str, int]:
    nxt = body[i + 1]
    if nxt in "xu":
        width = 2 if nxt == "x" else 4
        return chr(int(body[i + 2 : i + 2 + width], 16)), i + 2 + width
    return {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}.get(nxt, nxt), i + 2


def _class(body: str, start: int) -> tuple[str, int]:
    """A character class, limited to what needs no escape in JSON text (negated ones to
    printable ASCII)."""
    negated = body.startswith("[^", start)
    i = start + (2 if negated else 1)
    members: list[str] = []
    first = True
    while i < len(body) and (body[i] != "]" or first):
        first = False
        if body[i] == "\\":
            nxt = body[i + 1]
            if nxt in _CLASS_ESCAPES:
                members.append(_CLASS_ESCAPES[nxt])
                i += 2
                continue
            if nxt in _NEGATED_ESCAPES:
                raise RegexProblem(i, f"`\\{nxt}` inside a class is not supported by this backend")
            char, i = _escaped_char(body, i)
            members.append("\\x2d" if char == "-" else _class_char(char))
            continue
        char, i = body[i], i + 1
        members.append(_class_char(char))
    end = i + 1
    inner = "".join(members)
    if negated:
        return f"[[^{inner}]&&{_PRINTABLE}]", end
    return f"[[{inner}]&&{_SAFE_CLASS}]", end


def _class_char(c: str) -> str:
    if c == "-":
        return "-"
    if c in "[]\\^&~" or ord(c) < 0x20:
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{{{ord(c):x}}}"
    return c
