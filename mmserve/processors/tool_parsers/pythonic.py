"""Pythonic format: the output starts with a Python list of calls, `[f(a=1, b="x"), g()]`,
optionally inside `<|python_start|>` ... `<|python_end|>` (Llama 3.2 / Llama 4 style).

Parsed with `ast`, never evaluated: a call is a (dotted) name with keyword arguments whose
values are literals (`ast.literal_eval`), converted to a JSON object. Only an output that
starts (after whitespace) with `[` or `<|python_start|>` can hold calls. In a closed list,
the calls are salvaged: an element that is not such a call (a broken one, a positional
argument, a keyword given twice) is content, verbatim, and the others are calls. A list
with no call in it, or one that never closes, is content as a whole.
"""

from __future__ import annotations

import ast
import re

from .base import Accept, StreamingToolParser, ToolParser, canonical_arguments
from .scan import IN_STRING, BalancedScanner, Scan

START, END = "<|python_start|>", "<|python_end|>"
_SPLIT = re.compile(r"[^\"'()\[\]{},]*")  # what the element splitter skips over


class PythonicStream(StreamingToolParser):
    _scanner = BalancedScanner(0, python=True)  # the list

    def _start(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            return self._all_content() if reader.final else False
        tag = reader.starts(START)
        if tag is None:
            return False
        if tag:
            reader.pos += len(START)
        self._scanner = BalancedScanner(reader.pos, opening="[", python=True)
        self._state = self._list
        return True

    def _list(self) -> bool:
        reader, scanner = self._in, self._scanner
        state = self._scan(scanner)
        if state is None:
            return False
        calls: list[tuple[str, str]] = []
        rest: list[str] = []
        if state is Scan.END:
            calls, rest = salvage(reader.text(scanner.start, scanner.pos), self._accepts)
        if not calls:
            return self._all_content()
        reader.pos = reader.keep = scanner.pos
        for call in calls:
            self._call(*call)
        if rest:
            self._content(", ".join(rest))
        self._state = self._end
        return True

    def _end(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            return self._all_content() if reader.final else False
        tag = reader.starts(END)
        if tag is None:
            return False
        if tag:
            reader.pos = reader.keep = reader.pos + len(END)
        return self._all_content()


def salvage(source: str, accept: Accept) -> tuple[list[tuple[str, str]], list[str]]:
    """The accepted calls of a list `[f(a=1), g(]` as [(name, arguments JSON)], and the
    texts of its elements that are not such calls."""
    tree = _parse(source)
    if isinstance(tree, ast.List):  # the usual case, in one parse: every element a call
        every = [_call(node) for node in tree.elts]
        if every and all(c is not None and accept(*c) for c in every):
            return every, []  # type: ignore[return-value]  # no None in it
    calls, rest = [], []
    for text in _elements(source):
        call = _call(_parse(text))
        if call is not None and accept(*call):
            calls.append(call)
        else:
            rest.append(text)
    return calls, rest


def _elements(source: str) -> list[str]:
    """The texts of a list's elements: the text inside its brackets split at the commas
    outside brackets and strings (the elements need not parse)."""
    out, depth, quote, start, i, end = [], 0, "", 1, 1, len(source) - 1
    while i < end:
        if quote:
            i = IN_STRING[quote].match(source, i).end()  # type: ignore[union-attr]
            if i < end:
                escape = source[i] == "\\"
                quote, i = (quote if escape else ""), i + (2 if escape else 1)
            continue
        i = _SPLIT.match(source, i).end()  # type: ignore[union-attr]  # `*` always matches
        c = source[i] if i < end else ""
        if c in ("'", '"'):
            quote = c
        elif c in ("(", "[", "{"):
            depth += 1
        elif c in (")", "]", "}"):
            depth -= 1
        elif c == "," and depth == 0:
            out.append(source[start:i])
            start = i + 1
        i += 1
    out.append(source[start:end])
    return [text.strip() for text in out if text.strip()]


def _parse(source: str) -> ast.expr | None:
    try:
        return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _call(node: ast.expr | None) -> tuple[str, str] | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted_name(node.func)
    values = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in values:  # **kwargs, or a repeated keyword
            return None
        try:
            values[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    arguments = canonical_arguments(values)  # tuples become lists; sets, bytes... refused
    return None if name is None or arguments is None else (name, arguments)


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


class PythonicParser(ToolParser):
    name = "pythonic"
    stream_class = PythonicStream
    markers = (START, END)
