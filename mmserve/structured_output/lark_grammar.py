"""Lark grammars for `structured.grammar`, rewritten as the EBNF (GBNF) that xgrammar compiles.

vLLM takes a Lark grammar where it takes EBNF, and so does mmserve: a grammar whose definitions
read `name: ...` (Lark) rather than `name ::= ...` (EBNF) is converted here, then compiled like
any EBNF grammar. What carries over:

- rules and terminals (`rule:`, `?rule:`, `!rule:`, `TERM:`, priorities `.N`), `start` as the
  root (without one, the first rule, as vLLM takes it); alternatives `|` (also opening a
  continuation line), aliases `-> name` (dropped);
- groups `( )`, optional `[ ]`, `?`, `*`, `+`, repeats `~ n` and `~ n..m`;
- strings with Python escapes, case-insensitive strings `"..."i`, ranges `"a".."z"`, regular
  expressions `/.../` (without flags; xgrammar turns each into rules of its own);
- `%import common.NAME`, `%import common (A, B)` and `%import common.NAME -> ALIAS`, from a copy
  of Lark's common.lark (ESCAPED_STRING without its look-behind);
- `%ignore`: what Lark skips between tokens is allowed where Lark skips it: between the items
  of a rule (and between its repeats) and before the text; never inside a terminal, and not
  after the text (a model would go on writing newlines where it could end).

Refused, naming the line: templates, `%declare`, `%override`, `%extend`, imports from other
modules, regex flags, undefined names. A caveat of a context-free rendering: Lark's lexer
takes the longest match, so two adjacent terminals that can run into each other (`WORD WORD`
without a separator) may be generated as text Lark itself would lex differently; the output
always matches the grammar as a context-free one."""

from __future__ import annotations

import ast
import functools
import json
import re
import warnings
from dataclasses import dataclass, field

import xgrammar as xgr


class LarkProblem(ValueError):
    """A Lark grammar mmserve cannot convert: the message says what and where."""


# a definition line: `name:` or `NAME:` with optional ?/! and priority, not EBNF's `::=`
_LARK_DEF = re.compile(r"^\s*[?!]?[_A-Za-z][_A-Za-z0-9]*(\.-?\d+)?\s*:(?!:=)")
_EBNF_DEF = re.compile(r"^\s*[_A-Za-z][-_A-Za-z0-9]*\s*::=")


def _strip_comment_line(line: str) -> str:
    """The line blanked when it is a `//` or `#` comment (for detection only)."""
    return re.sub(r"^\s*(//|#).*$", "", line)


def is_lark(text: str) -> bool:
    """True when the grammar is written in Lark's syntax: no definition reads `name ::= ...`,
    and one reads `name: ...` or a line is a Lark directive (`%import`, `%ignore`)."""
    lines = [_strip_comment_line(line) for line in text.splitlines()]
    if any(_EBNF_DEF.match(line) for line in lines):
        return False
    return any(_LARK_DEF.match(line) or line.lstrip().startswith("%") for line in lines)


# Lark's common.lark (lark 1.x), in Lark syntax; ESCAPED_STRING without the look-behind
COMMON = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f"|"A".."F"|DIGIT
INT: DIGIT+
SIGNED_INT: ["+"|"-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e"|"E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+"|"-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+"|"-"] NUMBER
_STRING_ESC_INNER: /([^"\\\n]|\\[^\n])*/
ESCAPED_STRING: "\"" _STRING_ESC_INNER "\""
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_"|LETTER) ("_"|LETTER|DIGIT)*
WS_INLINE: (" "|/\t/)+
WS: /[ \t\f\r\n]/+
CR: /\r/
LF: /\n/
NEWLINE: (CR? LF)+
SH_COMMENT: /#[^\n]*/
CPP_COMMENT: /\/\/[^\n]*/
C_COMMENT: "/*" /([^*]|\*+[^*\/])*/ "*"+ "/"
SQL_COMMENT: /--[^\n]*/
"""

_TOKEN = re.compile(
    r"""
    (?P<nl>\r?\n)
  | (?P<space>[ \t\f\r]+)
  | (?P<comment>(//|\#)[^\n]*)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?!/)(?:\\/|\\\\|[^/\n])*?/[imslux]*)
  | (?P<directive>%[a-z]+)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>[_A-Za-z][_A-Za-z0-9]*)
  | (?P<number>-?\d+)
  | (?P<op>[:|()\[\]?*+~{},.!])
    """,
    re.VERBOSE,
)


@dataclass
class _Tok:
    kind: str
    text: str
    line: int
    first: bool  # the first token on its line


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos, line, first = 0, 1, True
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise LarkProblem(f"Lark grammar: unexpected character {text[pos]!r} at line {line}")
        kind = m.lastgroup or ""
        if kind == "nl":
            line, first = line + 1, True
        elif kind not in ("space", "comment"):
            out.append(_Tok(kind, m.group(), line, first))
            first = False
        pos = m.end()
    return out


@dataclass
class _Def:
    name: str
    line: int
    body: list[_Tok] = field(default_factory=list)


def _is_head(toks: list[_Tok], i: int) -> bool:
    """Does a definition (`[?!]name[.N]:`) start at toks[i], the first token of its line?"""
    j = i + 1 if toks[i].text in ("?", "!") else i
    if j >= len(toks) or toks[j].kind != "name":
        return False
    j += 1
    if j + 1 < len(toks) and toks[j].text == "." and toks[j + 1].kind == "number":
        j += 2
    if j < len(toks) and toks[j].text == "{":
        raise LarkProblem(f"Lark grammar: templates are not supported (line {toks[i].line})")
    return j < len(toks) and toks[j].text == ":"


def _statements(toks: list[_Tok]) -> tuple[list[_Def], list[list[_Tok]]]:
    """Definitions and directives; a line that starts neither continues the one before."""
    defs: list[_Def] = []
    directives: list[list[_Tok]] = []
    current: list[_Tok] | None = None
    i = 0
    while i < len(toks):
        tok = toks[i]
        if tok.first and tok.kind == "directive":
            current = [tok]
            directives.append(current)
        elif tok.first and _is_head(toks, i):
            if tok.text in ("?", "!"):
                i += 1
            name = toks[i]
            i += 1
            if toks[i].text == ".":
                i += 2  # a priority: no meaning to a context-free grammar
            d = _Def(name.text, name.line)
            defs.append(d)
            current = d.body
        elif current is None:
            raise LarkProblem(f"Lark grammar: expected a definition at line {tok.line}")
        else:
            current.append(tok)
        i += 1
    return defs, directives


def _literal(tok: _Tok) -> str:
    text = tok.text.removesuffix("i")
    try:
        with warnings.catch_warnings():  # "\d" stays a backslash and a d, as in Lark
            warnings.simplefilter("ignore")
            value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise LarkProblem(f"Lark grammar: bad string {tok.text} at line {tok.line}") from None
    if not isinstance(value, str):
        raise LarkProblem(f"Lark grammar: bad string {tok.text} at line {tok.line}")
    return value


def _class_char(c: str) -> str:
    if c in "\\]^-[":
        return "\\" + c
    if c.isprintable():
        return c
    return f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"


def _string(value: str, insensitive: bool) -> str:
    if not insensitive:
        return json.dumps(value, ensure_ascii=False)
    parts = [
        f"[{_class_char(c.lower())}{_class_char(c.upper())}]"
        if c.lower() != c.upper()
        else json.dumps(c, ensure_ascii=False)
        for c in value
    ]
    return "(" + " ".join(parts) + ")" if parts else '""'


_EBNF_IDENT = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[_A-Za-z][-_A-Za-z0-9]*')


def _renamed(ebnf: str, names: dict[str, str]) -> str:
    """ebnf with its rule names mapped, leaving string literals and classes alone."""

    def sub(m: re.Match[str]) -> str:
        word = m.group()
        return names.get(word, word) if word[0] not in '"[' else word

    return _EBNF_IDENT.sub(sub, ebnf)


GAP, IGNORED = "lark_gap", "lark_ignored"  # %ignore'd text between a rule's items, and one piece of it


def _is_rule(name: str) -> bool:
    """Lark's rules are lower case (terminals upper case), after any leading underscores."""
    return name.lstrip("_")[:1].islower()


class _Converter:
    """Names and the regexes' rules: the grammar's own names stay (the start rule becomes
    `root`, another rule named `root` becomes `lark_root`); common.lark's are namespaced
    `common__NAME`, as Lark does with an import's dependencies, so they never meet the
    grammar's own."""

    def __init__(self, taken: set[str], start: str, ignores: bool) -> None:
        self.extra: list[str] = []  # the regexes' rules
        self.regexes = 0
        self.taken = set(taken) | {GAP, IGNORED, "lark_start"}
        # the start rule's name; with %ignore, root is the start rule after ignored text
        self.names = {"root": "lark_root", start: "lark_start" if ignores else "root"}

    def name_of(self, name: str, common: bool) -> str:
        if common:
            return f"common__{name}"
        return self.names.get(name, name)

    def fresh(self, base: str) -> str:
        while True:
            self.regexes += 1
            name = f"{base}_re{self.regexes}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def regex(self, tok: _Tok, owner: str) -> str:
        body, _, flags = tok.text[1:].rpartition("/")
        if flags:
            raise LarkProblem(
                f"Lark grammar: regex flags ({flags}) are not supported (line {tok.line})"
            )
        pattern = body.replace("\\/", "/")
        try:
            ebnf = str(xgr.Grammar.from_regex(pattern))
        except (RuntimeError, ValueError):
            raise LarkProblem(
                f"Lark grammar: the regex {tok.text} at line {tok.line} is not supported"
            ) from None
        rules = re.findall(r"^([_A-Za-z][-_A-Za-z0-9]*) ::=", ebnf, re.MULTILINE)
        names = {r: self.fresh(owner) for r in rules}
        self.extra.append(_renamed(ebnf, names).strip())
        return names["root"]


class _Parser:
    """Recursive descent over one definition's tokens, writing EBNF."""

    def __init__(
        self, conv: _Converter, owner: str, toks: list[_Tok], line: int, common: bool,
        gap: str | None = None,
    ) -> None:
        self.conv, self.owner, self.toks, self.line, self.i = conv, owner, toks, line, 0
        self.common = common  # a common.lark definition: its names are common.lark's
        self.gap = gap  # a rule's (not a terminal's): the %ignore'd text allowed between items
        self.refs: set[str] = set()

    def peek(self) -> _Tok | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def fail(self, what: str) -> LarkProblem:
        tok = self.peek()
        line = tok.line if tok else self.line
        return LarkProblem(f"Lark grammar: {what} at line {line}")

    def take(self, text: str) -> None:
        tok = self.peek()
        if tok is None or tok.text != text:
            raise self.fail(f"expected {text!r}")
        self.i += 1

    def expansions(self, closing: str | None) -> str:
        alts = [self.alias(closing)]
        while (tok := self.peek()) is not None and tok.text == "|":
            self.i += 1
            alts.append(self.alias(closing))
        return " | ".join(alts)

    def alias(self, closing: str | None) -> str:
        items: list[str] = []
        while (tok := self.peek()) is not None and tok.text not in ("|", "->", closing):
            atom, repeat = self.expr()
            # in a rule, %ignore'd text may come before each item but the first; an item that
            # may be absent takes it along, so that a rule never ends in ignored text
            lead = self.gap if self.gap and items else None
            items.append(self.render(atom, repeat, lead))
        if (tok := self.peek()) is not None and tok.text == "->":
            self.i += 1
            if (name := self.peek()) is None or name.kind != "name":
                raise self.fail("expected an alias name after '->'")
            self.i += 1
        return " ".join(items) if items else '""'

    def expr(self) -> tuple[str, str | tuple[int, int] | None]:
        """An atom and its repeat: None, "?", "*", "+" or (n, m) for `~ n..m`."""
        if (tok := self.peek()) is not None and tok.text == "[":  # [x]: x, optional
            self.i += 1
            atom = f"({self.expansions(']')})"
            self.take("]")
            if (tok := self.peek()) is None or tok.text not in ("?", "*", "+", "~"):
                return atom, "?"
            atom += "?"  # ([x] repeated)
        else:
            atom = self.atom()
        tok = self.peek()
        if tok is None or tok.text not in ("?", "*", "+", "~"):
            return atom, None
        self.i += 1
        return atom, (self.counts() if tok.text == "~" else tok.text)

    def render(self, atom: str, repeat: str | tuple[int, int] | None, lead: str | None) -> str:
        """An item in EBNF, `lead` (the ignored text) before each of its repeats, if given;
        between them in a rule (the gap) otherwise."""
        if isinstance(repeat, tuple) and repeat[1] == 0:  # `~ 0`: nothing
            return '""'
        if lead:
            atom = f"({lead} {atom})"
        if repeat is None or repeat == "?" or not self.gap or lead:
            if not isinstance(repeat, tuple):
                return f"{atom}{repeat or ''}"
            low, high = repeat
            return f"{atom}{{{low}}}" if low == high else f"{atom}{{{low},{high}}}"
        # the first item of a rule's sequence, repeated: x (gap x)*, x (gap x){n-1,m-1}
        more = f"({self.gap} {atom})"
        if not isinstance(repeat, tuple):
            return f"({atom} {more}*)" + ("?" if repeat == "*" else "")
        low, high = repeat
        lo, hi = max(low - 1, 0), high - 1
        rest = "" if hi == 0 else f" {more}{{{lo}}}" if lo == hi else f" {more}{{{lo},{hi}}}"
        return f"({atom}{rest})" + ("?" if low == 0 else "")

    def counts(self) -> tuple[int, int]:
        """`~ n` or `~ n..m` after the `~`."""
        low = self.number()
        high = low
        if (nxt := self.peek()) is not None and nxt.kind == "range":
            self.i += 1
            high = self.number()
        if high < low:
            raise self.fail(f"repeat ~{low}..{high} runs backwards")
        return low, high

    def number(self) -> int:
        tok = self.peek()
        if tok is None or tok.kind != "number" or int(tok.text) < 0:
            raise self.fail("expected a count after '~'")
        self.i += 1
        return int(tok.text)

    def atom(self) -> str:
        tok = self.peek()
        if tok is None:
            raise self.fail("unexpected end of definition")
        self.i += 1
        if tok.text == "(":
            inner = self.expansions(")")
            self.take(")")
            return f"({inner})"
        if tok.kind == "string":
            if (nxt := self.peek()) is not None and nxt.kind == "range":
                self.i += 1
                end = self.peek()
                if end is None or end.kind != "string":
                    raise self.fail("expected a string after '..'")
                self.i += 1
                low, high = _literal(tok), _literal(end)
                if len(low) != 1 or len(high) != 1 or low > high:
                    raise self.fail(f"bad range {tok.text}..{end.text}")
                return f"[{_class_char(low)}-{_class_char(high)}]"
            return _string(_literal(tok), tok.text.endswith("i"))
        if tok.kind == "regex":
            return self.conv.regex(tok, self.owner)
        if tok.kind == "name":
            if (nxt := self.peek()) is not None and nxt.text == "{":
                raise self.fail("templates are not supported")
            self.refs.add(tok.text)
            return self.conv.name_of(tok.text, self.common)
        raise LarkProblem(f"Lark grammar: unexpected {tok.text!r} at line {tok.line}")


def _imports(directives: list[list[_Tok]]) -> dict[str, str]:
    """`%import common...` -> {name in the grammar: name in common}; other directives checked."""
    names: dict[str, str] = {}
    for d in directives:
        kind, line, rest = d[0].text, d[0].line, [t.text for t in d[1:]]
        if kind == "%ignore":
            continue
        if kind != "%import":
            raise LarkProblem(f"Lark grammar: {kind} is not supported (line {line})")
        if len(rest) >= 3 and rest[:2] == ["common", "."]:
            target = rest[2]
            if rest[3:] and (len(rest) != 5 or rest[3] != "->"):
                raise LarkProblem(f"Lark grammar: bad %import at line {line}")
            names[rest[4] if rest[3:] else target] = target
        elif len(rest) >= 4 and rest[0] == "common" and rest[1] == "(" and rest[-1] == ")":
            for name in rest[2:-1]:
                if name != ",":
                    names[name] = name
        else:
            raise LarkProblem(
                f"Lark grammar: only %import common... is supported (line {line})"
            )
    return names


@functools.cache
def _common_defs() -> dict[str, _Def]:
    """COMMON's definitions, parsed once (read, never changed, by each conversion)."""
    defs, _ = _statements(_tokens(COMMON))
    return {d.name: d for d in defs}


def lark_to_ebnf(text: str) -> str:
    """The grammar in xgrammar's EBNF, its start rule as `root` (`start`, else the first rule),
    with only what that rule reaches."""
    defs, directives = _statements(_tokens(text))
    common = _common_defs()
    own: dict[str, _Def] = {}
    for definition in defs:
        if definition.name in own:
            raise LarkProblem(
                f"Lark grammar: {definition.name} is defined twice (line {definition.line})"
            )
        own[definition.name] = definition
    # `start`, as Lark's default; else, as vLLM takes it, the first rule
    start = "start" if "start" in own else next((d.name for d in defs if _is_rule(d.name)), None)
    if start is None:
        raise LarkProblem("Lark grammar: no rule to start from (`start`, or any lower-case rule)")
    imports = _imports(directives)  # name here -> common.lark's name
    for alias, target in imports.items():
        if target not in common:
            raise LarkProblem(f"Lark grammar: common.lark has no {target}")
        if alias in own:
            raise LarkProblem(f"Lark grammar: {alias} is both imported and defined")
    ignores = [d[1:] for d in directives if d[0].text == "%ignore"]
    conv = _Converter(set(own) | set(imports) | {"root"}, start, bool(ignores))
    rules: list[str] = []
    pending: list[tuple[str, bool]] = [(start, False)]  # (name, in common.lark)
    done: set[tuple[str, bool]] = set()
    if ignores:  # what Lark skips between tokens: allowed before the text and between items
        pieces = []
        for toks in ignores:
            parser = _Parser(conv, IGNORED, toks, toks[0].line if toks else 0, False)
            pieces.append(f"({parser.expansions(None)})")
            pending.extend((ref, False) for ref in sorted(parser.refs, reverse=True))
        # not after the text: a model would go on writing ignored text (newlines) for ever
        # where it could end; text without it is in the language all the same
        rules += [f"root ::= {GAP} lark_start", f"{GAP} ::= {IGNORED}*",
                  f"{IGNORED} ::= {' | '.join(pieces)}"]
    while pending:
        key = pending.pop()
        if key in done:
            continue
        done.add(key)
        name, in_common = key
        if not in_common and name in imports:  # the rule is common.lark's
            rules.append(f"{conv.name_of(name, False)} ::= {conv.name_of(imports[name], True)}")
            pending.append((imports[name], True))
            continue
        found = (common if in_common else own).get(name)
        if found is None:
            raise LarkProblem(f"Lark grammar: {name} is used but not defined")
        gap = GAP if ignores and not in_common and _is_rule(name) else None
        parser = _Parser(conv, conv.name_of(name, in_common), found.body, found.line, in_common, gap)
        try:
            body = parser.expansions(None)
        except RecursionError:
            raise LarkProblem(f"Lark grammar: {name} is nested too deeply (line {found.line})") from None
        if (extra := parser.peek()) is not None:
            raise LarkProblem(f"Lark grammar: unexpected {extra.text!r} at line {extra.line}")
        rules.append(f"{conv.name_of(name, in_common)} ::= {body}")
        pending.extend((ref, in_common) for ref in sorted(parser.refs, reverse=True))
    return "\n".join(rules + conv.extra) + "\n"
