"""Tool calls as the models people run write them (issue 17): text that holds no call comes
back exactly, a marker at its end included. Each golden output is checked one-shot and
under every chunking: split at each position, char by char, and at random cuts."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.processors.tool_parsers import Accept, get_parser
from mmserve.processors.tool_parsers.base import collect

TOOLS = {"get_weather", "get_time", "a", "b", "f", "g"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
PARIS = ("get_weather", '{"city":"Paris"}')


def declared(name: str, arguments: str) -> bool:
    return name in TOOLS


# A marker at the very end, or anything that holds no complete call, is content exactly.
UNFINISHED = [
    ("hermes", "Let me check. <tool_call>"),
    ("hermes", "Let me check. <tool_call>\n"),
    ("hermes", "<tool_call>"),
    ("hermes", "<tool_call> {"),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    ("mistral", "Let me check. [TOOL_CALLS]"),
    ("mistral", "[TOOL_CALLS] "),
    ("mistral", "[TOOL_CALLS]get_weather"),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]"),
    ("mistral", "[TOOL_CALLS]get_weather[CALL_ID]abc"),
    ("llama3_json", "<|python_tag|>"),
    ("llama3_json", "Hi <|python_tag|>\n"),
    ("llama3_json", "<|python_tag|>{"),
    ("pythonic", "<|python_start|>"),
    ("pythonic", "  <|python_start|>[f(a=1)"),
]

GOLDEN = [
    *[(fmt, text, text, []) for fmt, text in UNFINISHED],
]


def run(fmt: str, chunks: list[str], accept: Accept | None) -> tuple[str, list[tuple[str, str]]]:
    stream = get_parser(fmt).stream(accept)
    deltas = [d for chunk in chunks for d in stream.feed(chunk)] + stream.finish()
    content, calls = collect(deltas)
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), GOLDEN)
def test_golden_under_every_chunking(fmt: str, text: str, content: str, calls: list) -> None:
    expected = (content, calls)
    assert run(fmt, [text], declared) == expected
    assert run(fmt, list(text), declared) == expected
    assert run(fmt, [text[i : i + 7] for i in range(0, len(text), 7)], declared) == expected
    for i in range(len(text) + 1):
        assert run(fmt, [text[:i], text[i:]], declared) == expected, i


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(GOLDEN), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_golden_at_random_cuts(case: tuple[str, str, str, list], cuts: list[int]) -> None:
    fmt, text, content, calls = case
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert run(fmt, chunks, declared) == (content, calls)
