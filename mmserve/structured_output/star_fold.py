"""Folding a repetition into the terminal after it, in xgrammar's normalised EBNF.

xgrammar normalises `X*` into a rule of its own, `R ::= ("" | (X R))`, and leaves the terminal
that follows it in the referring sequence: `"\\"" char* "\\""` becomes `"\\"" R "\\""`. With
xgrammar 0.2.9 and Llama 3's 128,256 tokens, one row's mask inside such a string took about
120 ms when `char` has a multi-character escape (llama.cpp's json.gbnf: `"\\" (... | "u"
[0-9a-fA-F]{4})`; with one-character escapes only, 0.04 ms), and the whole batch waits for it
at every step. Written right-recursively with the terminal inside, as xgrammar's own
JSON-schema converter writes strings, the same mask took 0.2-0.4 ms. Why xgrammar is slow on
the first form was not looked into. `X+ T` (90-127 ms, folded or not) and `X{0,N} T` (724 ms at
N = 200) stay slow.

`fold_star_terminals` makes that rewrite: a sequence `... R T ...`, with R such a repetition
referenced nowhere else and T a string literal or a character class, becomes `... R' ...` with
`R' ::= ((T) | (X R'))`. Both derive exactly X* T, so the language is unchanged. Anything else
(a repetition used twice, followed by a rule or by nothing, or with a lookahead) is left as
it is.
"""

from __future__ import annotations

import re

_NAME = r"(?<![A-Za-z0-9_.\-])[A-Za-z_][A-Za-z0-9_.\-]*"  # a rule's name (GBNF's item-name too)
_RULE = re.compile(f"({_NAME}) ::= (.*)")
# a string literal (with escapes) or a character class, as xgrammar prints them
_TERMINAL = r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]'
_WORD = re.compile(_NAME)
# a rule reference followed by a terminal in the same sequence (searched in a masked body)
_USE = re.compile(f"({_NAME}) ({_TERMINAL})(?=[ )])")
_ALIAS = re.compile(f"\\(\\(({_NAME})\\)\\)")  # a body that is one reference


def _masked(body: str) -> str:
    """body with the insides of its literals and character classes blanked out (same length):
    rule names and sequences are searched for outside them only."""
    return re.sub(_TERMINAL, lambda m: m.group()[0] + "#" * (len(m.group()) - 2) + m.group()[-1], body)


def _sequence(text: str) -> bool:
    """Whether text (a masked body's part) is one sequence: no `|` and no parenthesis closed
    outside it (`a) | (b` is two alternatives' ends, not a sequence)."""
    depth = 0
    for char in text:
        depth += (char == "(") - (char == ")")
        if depth < 0 or (depth == 0 and char == "|"):
            return False
    return depth == 0


def _star(head: str, body: str) -> str | None:
    """X when body is the repetition rule head's, `("" | (X head))` with X one sequence; else
    None."""
    start, end = '("" | (', f" {head}))"
    if body.startswith(start) and body.endswith(end) and len(body) > len(start) + len(end):
        x = body[len(start) : -len(end)]
        return x if _sequence(_masked(x)) else None
    return None


def _references(masked: list[str]) -> dict[str, int]:
    """How often each word occurs in the masked bodies: rule references."""
    counts: dict[str, int] = {}
    for body in masked:
        for word in _WORD.findall(body):
            counts[word] = counts.get(word, 0) + 1
    return counts


def fold_star_terminals(ebnf: str) -> str:
    """ebnf (str() of an xgrammar Grammar: one `name ::= body` a line) with each repetition
    that a terminal follows folded into it (module docstring); unchanged where none is. A rule
    that is only a repetition (`chars ::= char*`, normalised `chars ::= ((chars_1))`) counts as
    that repetition. Linear in the grammar's length (a request's grammar is up to 128 KiB)."""
    lines = ebnf.rstrip("\n").split("\n")
    parsed = [_RULE.fullmatch(line) for line in lines]
    if not all(parsed):
        return ebnf  # (not the normalised form this expects)
    heads = [m.group(1) for m in parsed if m]
    bodies = [m.group(2) for m in parsed if m]
    index = {head: k for k, head in enumerate(heads)}
    refs = _references([_masked(b) for b in bodies])
    for k, head in enumerate(heads):  # an alias of a repetition used only there becomes it
        alias = _ALIAS.fullmatch(bodies[k])
        inner = alias.group(1) if alias else ""
        star = _star(inner, bodies[index[inner]]) if inner in index and inner != head else None
        if star is not None and refs.get(inner) == 2:
            bodies[k] = f'("" | ({star} {head}))'
    masked = [_masked(b) for b in bodies]
    refs = _references(masked)
    uses: dict[str, list[tuple[int, re.Match[str]]]] = {}
    for i, body in enumerate(masked):
        for m in _USE.finditer(body):
            uses.setdefault(m.group(1), []).append((i, m))
    names, added = set(heads), []
    edits: dict[int, list[tuple[int, int, str]]] = {}
    for k, head in enumerate(heads):
        star = _star(head, bodies[k])
        found = [(i, m) for i, m in uses.get(head, []) if i != k]
        if star is None or refs.get(head) != 2 or len(found) != 1:
            continue  # not a repetition, one referenced other than once, or no terminal after it
        i, m = found[0]
        terminal = bodies[i][m.start(2) : m.end(2)]  # (unmasked)
        folded = head + "_then"
        while folded in names:
            folded += "_"
        names.add(folded)
        edits.setdefault(i, []).append((m.start(), m.end(), folded))
        added.append(f"{folded} ::= (({terminal}) | ({star} {folded}))")
    if not added:
        return ebnf  # (aliases too stay as they were: nothing gained)
    for i, spans in edits.items():  # (from the end, so that earlier offsets hold)
        for start, end, folded in sorted(spans, reverse=True):
            bodies[i] = bodies[i][:start] + folded + bodies[i][end:]
    return "\n".join([f"{h} ::= {b}" for h, b in zip(heads, bodies)] + added) + "\n"
