"""Parsing takes time linear in the length of the output, one-shot and streamed in small
chunks, on adversarial outputs: a malformed call repeated (each start tag used to rescan the
rest of the output: 24k characters of hermes took 7 s, so a megabyte would take hours),
markers and brackets by the thousand, values that never close, long runs held back while
undecided. The bounds leave room for a slow shared machine; a quadratic parser misses them
by orders of magnitude, and the growth check (4x the text, under 10x the time) catches one
whose constant is small."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from mmserve.frontend.tool_stream import ForcedCallStream
from mmserve.processors.tool_parsers import StreamingToolParser, get_parser

MB = 1_000_000


def declared(name: str, arguments: str) -> bool:
    return name in ("f", "get_weather")


def repeat(unit: str, head: str = "", tail: str = "") -> Callable[[int], str]:
    return lambda n: head + unit * (n // len(unit)) + tail


# name -> (format, the text of about n characters, whether the request has tools)
ADVERSARIAL: dict[str, tuple[str, Callable[[int], str], bool]] = {
    "hermes unterminated openers": ("hermes", repeat("<tool_call>{"), False),
    "hermes looping unterminated calls": (
        "hermes",
        repeat('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n'),
        True,
    ),
    "hermes openers in strings": ("hermes", repeat('<tool_call>{"a": "'), False),
    "hermes one long string": ("hermes", repeat("<tool_call>", head='<tool_call>{"a": "'), False),
    "hermes whitespace after a call": (
        "hermes",
        repeat(" ", head='<tool_call>{"name": "f"}'),
        False,
    ),
    "hermes untagged, never closed": ("hermes", repeat('[{"a": ['), True),
    "hermes untagged, fenced": ("hermes", repeat("[", head="```json\n"), True),
    "mistral openers": ("mistral", repeat("[TOOL_CALLS]["), True),
    "mistral v11 names": ("mistral", repeat("[TOOL_CALLS]get_weather"), True),
    "mistral v11 strings": ("mistral", repeat('[TOOL_CALLS]f[ARGS]{"a": "'), True),
    "llama3 braces": ("llama3_json", repeat("{"), True),
    "llama3 nested, never closed": ("llama3_json", repeat('{"a":'), True),
    "llama3 tags and strings": ("llama3_json", repeat('<|python_tag|>{"a": "'), True),
    "llama3 separators": ("llama3_json", repeat(";", head='{"name": "f", "parameters": {}}'), True),
    "pythonic brackets": ("pythonic", repeat("["), False),
    "pythonic broken calls": (
        "pythonic",
        repeat('get_weather(city="Paris", days=), ', head="[", tail="f()]"),
        True,
    ),
    "forced calls, never closed": ("forced", repeat('{"name": "f", "arguments": {}}, ', "["), True),
}


def parse_time(fmt: str, text: str, tools: bool, chunk: int | None) -> float:
    accept = declared if tools else None
    stream: StreamingToolParser = (
        ForcedCallStream(accept=accept) if fmt == "forced" else get_parser(fmt).stream(accept)
    )
    start = time.perf_counter()
    if chunk is None:
        stream.feed(text)
    else:
        for i in range(0, len(text), chunk):
            stream.feed(text[i : i + chunk])
    stream.finish()
    return time.perf_counter() - start


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_a_megabyte_parses_in_seconds_not_minutes(name: str) -> None:
    """About a second each on one free core; the bound leaves room for a loaded CI machine
    (a parser that rescans its buffer per chunk takes minutes here)."""
    fmt, make, tools = ADVERSARIAL[name]
    assert parse_time(fmt, make(MB), tools, None) < 15.0
    assert parse_time(fmt, make(MB // 4), tools, 7) < 15.0


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_streaming_char_by_char_grows_linearly(name: str) -> None:
    fmt, make, tools = ADVERSARIAL[name]
    n = 20_000
    small = min(parse_time(fmt, make(n), tools, 1) for _ in range(5))  # least disturbed
    large = min(parse_time(fmt, make(4 * n), tools, 1) for _ in range(3))
    assert large < 10 * small + 0.05, (small, large)  # linear: 4x; quadratic: 16x
