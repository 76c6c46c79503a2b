"""Pythonic format: the output starts with a Python list of calls, `[f(a=1, b="x"), g()]`,
optionally inside `<|python_start|>` ... `<|python_end|>` (Llama 3.2 / Llama 4 style).

Parsed with `ast`, never evaluated: a call is a (dotted) name with keyword arguments whose
values are literals (`ast.literal_eval`), converted to a JSON object. Only an output that
starts (after whitespace) with `[` or `<|python_start|>` can hold calls; a list that is not
all such calls stays content.
"""

from __future__ import annotations

import ast

from .base import StreamingToolParser, ToolParser, canonical_arguments
from .scan import BalancedScanner, Scan

START, END = "<|python_start|>", "<|python_end|>"


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
        calls = parse_calls(reader.text(scanner.start, scanner.pos)) if state is Scan.END else None
        if calls is None or not all(self._accepts(*call) for call in calls):
            return self._all_content()
        reader.pos = reader.keep = scanner.pos
        for call in calls:
            self._call(*call)
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


def parse_calls(source: str) -> list[tuple[str, str]] | None:
    """`[f(a=1), g()]` -> [(name, arguments JSON)], or None if it is not that."""
    tree = _parse(source)
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = [_call(node) for node in tree.elts]
    return None if None in calls else calls  # type: ignore[return-value]  # no None in it


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
        if keyword.arg is None:  # **kwargs
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
