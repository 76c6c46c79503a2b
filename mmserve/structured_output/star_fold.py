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

_RULE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*) ::= (.*)")
# a string literal (with escapes) or a character class, as xgrammar prints them
_TERMINAL = r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]'


def _name(name: str) -> str:
    """A pattern of the rule name as a whole word."""
    return r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])"


def _masked(body: str) -> str:
    """body with the insides of its literals and character classes blanked out (same length):
    rule names and sequences are searched for outside them only."""
    return re.sub(_TERMINAL, lambda m: m.group()[0] + "#" * (len(m.group()) - 2) + m.group()[-1], body)


def _star(head: str, body: str) -> re.Match[str] | None:
    """Whether body is the repetition rule head's, `("" | (X head))`: X as group 1."""
    return re.fullmatch(r'\(""\s\|\s\((.+) ' + re.escape(head) + r"\)\)", body)


def _references(name: str, bodies: list[str]) -> int:
    return sum(len(re.findall(_name(name), _masked(b))) for b in bodies)


def fold_star_terminals(ebnf: str) -> str:
    """ebnf (str() of an xgrammar Grammar: one `name ::= body` a line) with each repetition
    that a terminal follows folded into it (module docstring); unchanged where none is. A rule
    that is only a repetition (`chars ::= char*`, normalised `chars ::= ((chars_1))`) counts as
    that repetition."""
    lines = ebnf.rstrip("\n").split("\n")
    parsed = [_RULE.fullmatch(line) for line in lines]
    if not all(parsed):
        return ebnf  # (not the normalised form this expects)
    heads = [m.group(1) for m in parsed if m]
    bodies = [m.group(2) for m in parsed if m]
    index = {head: k for k, head in enumerate(heads)}
    for k, head in enumerate(heads):  # an alias of a repetition used only there becomes it
        alias = re.fullmatch(r"\(\(([A-Za-z_][A-Za-z0-9_]*)\)\)", bodies[k])
        inner = alias.group(1) if alias else ""
        star = _star(inner, bodies[index[inner]]) if inner in index and inner != head else None
        if star is not None and _references(inner, bodies) == 2:
            bodies[k] = f'("" | ({star.group(1)} {head}))'
    names, added = set(heads), []
    for k, head in enumerate(heads):
        star = _star(head, bodies[k])
        masked = [_masked(b) for b in bodies]
        if star is None or _references(head, bodies) != 2:
            continue  # not a repetition, or one referenced other than once besides itself
        use = re.compile(_name(head) + r" (" + _TERMINAL + r")(?=[ )])")
        found = [(i, m) for i, b in enumerate(masked) if i != k for m in use.finditer(b)]
        if len(found) != 1:
            continue
        i, m = found[0]
        terminal = bodies[i][m.start(1) : m.end(1)]  # (unmasked)
        folded = head + "_then"
        while folded in names:
            folded += "_"
        names.add(folded)
        bodies[i] = bodies[i][: m.start()] + folded + bodies[i][m.end() :]
        added.append(f"{folded} ::= (({terminal}) | ({star.group(1)} {folded}))")
    if not added:
        return ebnf  # (aliases too stay as they were: nothing gained)
    return "\n".join([f"{h} ::= {b}" for h, b in zip(heads, bodies)] + added) + "\n"
