"""The `accept` hook: a well-formed call the caller refuses (an unknown tool, arguments that
break a strict schema) stays content, verbatim, in every format and at every chunking."""

from __future__ import annotations

import pytest

from mmserve.processors.tool_parsers import get_parser
from mmserve.processors.tool_parsers.base import collect

SAMPLES = {
    "hermes": 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    "llama3_json": '{"name": "f", "parameters": {"a": 1}}',
    "mistral": 'Hi [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]',
    "pythonic": "[f(a=1)]",
}


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_refused_calls_stay_content(fmt: str) -> None:
    text, parser = SAMPLES[fmt], get_parser(fmt)
    seen: list[tuple[str, str]] = []

    def refuse(name: str, arguments: str) -> bool:
        seen.append((name, arguments))
        return False

    assert parser.parse(text)[1][0].name == "f"  # accepted by default
    for size in (1, 3, len(text)):
        stream = parser.stream(refuse)
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i : i + size])]
        assert collect(deltas + stream.finish()) == (text, [])
    assert seen and set(seen) == {("f", '{"a":1}')}
    stream = parser.stream(lambda name, arguments: name == "f")
    assert [c.name for c in collect(stream.feed(text) + stream.finish())[1]] == ["f"]
