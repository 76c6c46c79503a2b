"""Pythonic format: the whole output is a Python list of calls, `[f(a=1, b="x"), g()]`,
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
    _state = "start"  # start -> calls -> end -> text
    _scanner: BalancedScanner | None = None
    _prefix = ""  # consumed whitespace / start tag: content if the list is malformed

    def _step(self) -> bool:
        if self._state == "text":
            self._content(self._take(len(self._buf)))
            return False
        return {"start": self._start, "calls": self._list, "end": self._end}[self._state]()

    def _start(self) -> bool:
        rest = self._buf.lstrip()
        if not self._final and (not rest or (START.startswith(rest) and rest != START)):
            return False  # only whitespace, or perhaps the start tag: wait
        gap = len(self._buf) - len(rest)
        if rest.startswith(START):
            self._prefix = self._take(gap + len(START))
        elif rest.startswith("["):
            self._prefix = self._take(gap)
        else:
            self._state = "text"
            return True
        self._state = "calls"
        self._scanner = BalancedScanner(quotes="\"'", opening="[")
        return True

    def _list(self) -> bool:
        assert self._scanner is not None
        state = self._scanner.scan(self._buf)
        if state is Scan.NEED_MORE and not self._final:
            return False
        calls = parse_calls(self._buf[: self._scanner.pos]) if state is Scan.END else None
        if calls is None or not all(self._accepts(n, a) for n, a in calls):
            self._content(self._prefix)
            self._state = "text"
            return True
        self._take(self._scanner.pos)
        for name, arguments in calls:
            self._call(name, arguments)
        self._state = "end"
        return True

    def _end(self) -> bool:
        rest = self._buf.lstrip()
        if not self._final and (not rest or (END.startswith(rest) and rest != END)):
            return False
        if rest.startswith(END):
            self._take(len(self._buf) - len(rest) + len(END))
        self._state = "text"
        return True


def parse_calls(source: str) -> list[tuple[str, str]] | None:
    """`[f(a=1), g()]` -> [(name, arguments JSON)], or None if it is not that."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [_call(node) for node in tree.body.elts]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _call(node: ast.expr) -> tuple[str, str] | None:
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
