"""Tool calls as the models people run write them (issue 17): untagged calls from a small
Qwen, Mistral's v11 `[TOOL_CALLS]name{...}`, Llama 3 calls after prose or several in a row,
pythonic lists with one broken call, keys and keywords given twice; and text that holds no
call coming back exactly, a marker at its end included. Each golden output is checked
one-shot and under every chunking: split at each position, char by char, and at random
cuts."""

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


# The outputs of a 0.5B Qwen2.5 coder asked with tool_choice auto and one tool: a correct call
# without its tags, fenced and bare. The formats that read untagged calls accept these where
# the request has tools, and only when the whole output is the calls.
UNTAGGED_CALLS = [
    (f"```json\n{WEATHER}\n```", [PARIS]),
    (WEATHER, [PARIS]),
    (f"\n\n```\n{WEATHER}\n```\n", [PARIS]),
    (f"```JSON {WEATHER}```", [PARIS]),
    (f"[{WEATHER}, {OSLO}]", [PARIS, ("get_weather", '{"city":"Oslo"}')]),
    (f"```json\n[{WEATHER}]\n```", [PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
]
NOT_CALLS = [  # text, verbatim, in every format that reads untagged calls
    '{"name": "launch", "arguments": {"target": "moon"}}',  # not a declared tool
    '{"name": "get_weather"}',  # no arguments: the keys are all that make it a call
    '{"name": "get_weather", "arguments": {"city": "Paris", "city": "Oslo"}}',  # repeated key
    '{"city": "Paris"}',
    "[1, 2]",
    "[link](x) and {braces}",
    "```",
    "`code`",
    "[",
]
NOT_UNTAGGED_CALLS = [  # text, verbatim, in hermes and mistral (llama3_json reads the call)
    f"{WEATHER}\nI called the tool.",  # text after it
    f"Calling: {WEATHER}",  # text before it
    f"```json\n{WEATHER}",  # the fence is not closed
    f"```json\n{WEATHER}\n```\n```json\n{OSLO}\n```",  # two fences
    f"```python\n{WEATHER}\n```",
    f'[{WEATHER}, {{"name": "launch", "arguments": {{}}}}]',  # one call is not a tool's
]
UNTAGGED = [
    (fmt, text, "", calls) for fmt in ("hermes", "mistral") for text, calls in UNTAGGED_CALLS
] + [
    (fmt, text, text, [])
    for fmt in ("hermes", "mistral")
    for text in NOT_CALLS + NOT_UNTAGGED_CALLS
]

LLAMA3 = [
    *[("llama3_json", text, "", calls) for text, calls in UNTAGGED_CALLS],
    ("llama3_json", f"{WEATHER}\nI called the tool.", "I called the tool.", [PARIS]),
    ("llama3_json", f"Calling: {WEATHER}", "Calling:", [PARIS]),
    ("llama3_json", f"```json\n{WEATHER}", "```json", [PARIS]),  # no fence to strip
    (
        "llama3_json",
        'Let me look that up. {"name": "get_weather", "parameters": {"city": "Paris"}}',
        "Let me look that up.",
        [PARIS],
    ),
    (
        "llama3_json",
        '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {"x": 1}}',
        "",
        [("a", "{}"), ("b", '{"x":1}')],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}<|python_tag|>{"name": "b", "parameters": {}}',
        "",
        [("a", "{}"), ("b", "{}")],
    ),
    (
        "llama3_json",
        'Sure!<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}',
        "Sure!",
        [("a", "{}"), ("b", "{}")],
    ),
    ("llama3_json", '{"name": "a", "parameters": {}}; bye', "; bye", [("a", "{}")]),
    (  # a call-shaped part of a JSON answer is not a call
        "llama3_json",
        '{"result": {"name": "a", "parameters": {}}}',
        '{"result": {"name": "a", "parameters": {}}}',
        [],
    ),
    (
        "llama3_json",
        'Use {braces} or {"name": "a", "parameters": {}}',
        "Use {braces} or",
        [("a", "{}")],
    ),
    *[("llama3_json", text, text, []) for text in NOT_CALLS],
]

MISTRAL_V11 = [
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}', "", [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [PARIS]),
    (
        "mistral",
        'Sure. [TOOL_CALLS]a{"x": 1}[TOOL_CALLS]b[ARGS]{}\n[TOOL_CALLS]get_weather {"city": "Paris"}',
        "Sure.",
        [("a", '{"x":1}'), ("b", "{}"), PARIS],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "a", "arguments": {}}][TOOL_CALLS]b{"y": [1]}',
        "",
        [("a", "{}"), ("b", '{"y":[1]}')],
    ),
    ("mistral", '[TOOL_CALLS]get_weather{"city": ', '[TOOL_CALLS]get_weather{"city": ', []),
    ("mistral", "[TOOL_CALLS]get weather{}", "[TOOL_CALLS]get weather{}", []),
    ("mistral", '[TOOL_CALLS]a{"x": 1, "x": 2}', '[TOOL_CALLS]a{"x": 1, "x": 2}', []),
    ("mistral", "[TOOL_CALLS]a[1]", "[TOOL_CALLS]a[1]", []),
    ("mistral", "[TOOL_CALLS]" + "a" * 65 + "{}", "[TOOL_CALLS]" + "a" * 65 + "{}", []),
    (  # a broken call does not swallow the good one after it
        "mistral",
        '[TOOL_CALLS]a{"x": "cut\n[TOOL_CALLS]b{}',
        '[TOOL_CALLS]a{"x": "cut',
        [("b", "{}")],
    ),
]

PYTHONIC_AND_REPEATS = [
    (
        "pythonic",
        '[get_weather(city="Paris"), get_time(tz=), get_weather(city="Oslo")]',
        "get_time(tz=)",
        [PARIS, ("get_weather", '{"city":"Oslo"}')],
    ),
    ("pythonic", "[f(a=1, a=2)]", "[f(a=1, a=2)]", []),  # a repeated keyword: not a call
    ("pythonic", "[f(a=1, a=2), g(b='x, y')]", "f(a=1, a=2)", [("g", '{"b":"x, y"}')]),
    ("pythonic", "[f(x), g(), 3]", "f(x), 3", [("g", "{}")]),
    ("pythonic", "[f(a=(1, ']'), b={'k': [2]}), g(]", "[f(a=(1, ']'), b={'k': [2]}), g(]", []),
    (  # a repeated key: not a call, whichever copy a client would read
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>',
        [],
    ),
    (
        "llama3_json",
        '{"name": "f", "name": "g", "parameters": {}}',
        '{"name": "f", "name": "g", "parameters": {}}',
        [],
    ),
]

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
    *UNTAGGED,
    *LLAMA3,
    *MISTRAL_V11,
    *PYTHONIC_AND_REPEATS,
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


def test_untagged_calls_need_the_requests_tools() -> None:
    """Without an accept hook (no tools known), untagged JSON is an answer, not a call."""
    for fmt in ("hermes", "mistral"):
        for text, _ in UNTAGGED_CALLS:
            assert get_parser(fmt).parse(text) == (text, []), (fmt, text)
    _, calls = get_parser("hermes").parse(WEATHER, accept=declared)
    assert [c.name for c in calls] == ["get_weather"]


def test_untagged_output_is_held_until_decided() -> None:
    """What a streaming client sees: output that starts like a call is held; anything else
    streams at once, and held text is given out as soon as it cannot be a call."""
    stream = get_parser("hermes").stream(declared)
    assert stream.feed("```json\n" + WEATHER) == []
    assert stream.feed("\n```\n") == []  # only whitespace may follow: held to the end
    assert [d.name for d in stream.finish()] == ["get_weather"]  # type: ignore[union-attr]
    stream = get_parser("hermes").stream(declared)
    assert stream.feed('{"city": "Paris"') == []
    assert collect(stream.feed("}")) == ('{"city": "Paris"}', [])  # closed, and not a call
    stream = get_parser("hermes").stream(declared)
    assert collect(stream.feed("Hello {")) == ("Hello {", [])  # not at the start: streams


def test_mistral_v11_call_ids() -> None:
    text = (
        '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris"}'
        "[TOOL_CALLS]a[CALL_ID]x[ARGS]{}"
    )
    content, calls = get_parser("mistral").parse(text)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [PARIS, ("a", "{}")]
    assert calls[0].id == "abcDEF123" and len(calls[1].id) == 9 and calls[1].id != "x"
