"""Property tests: however an output is chunked, the streamed result is the one-shot parse
(with and without the request's tools, which turn on untagged calls); an output in which
no call is found comes back exactly; and generated well-formed calls come back exactly,
with the text around them."""

from __future__ import annotations

import itertools
import json
import keyword
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.processors.tool_parsers import Accept, ToolCall, get_parser
from mmserve.processors.tool_parsers.base import collect
from tests.tool_parsers.test_tool_parsers_golden import GOLDEN

FORMATS = ("hermes", "llama3_json", "mistral", "pythonic")
MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|python_start|>",
           "<|python_end|>"]  # fmt: skip
# What else starts calls: untagged ones (fences, bare call objects), Mistral's v11 form.
FRAGMENTS = ["```json\n", "```", '{"name": "f", "arguments": {}}', '{"name": "g", "parameters":',
             "[ARGS]", "[CALL_ID]", "[TOOL_CALLS]f{", "f(a=1)", "f(a=1, a=2)"]  # fmt: skip
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def calls_of(result: tuple[str, list[ToolCall]]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = result
    return content, [(c.name, c.arguments) for c in calls]  # ids are random per stream


def declared(name: str, arguments: str) -> bool:
    return name in ("f", "g")


def streamed(
    fmt: str, chunks: list[str], accept: Accept | None = None
) -> tuple[str, list[tuple[str, str]]]:
    stream = get_parser(fmt).stream(accept)
    deltas = [d for chunk in chunks for d in stream.feed(chunk)] + stream.finish()
    return calls_of(collect(deltas))


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def test_golden_outputs_split_at_every_position() -> None:
    for fmt, text, _, _ in GOLDEN:
        expected = calls_of(get_parser(fmt).parse(text))
        for i in range(len(text) + 1):
            assert streamed(fmt, [text[:i], text[i:]]) == expected, (fmt, i)


# Text with everything that could confuse a parser: markers and their prefixes, brackets,
# quotes, backslashes, separators, whitespace, non-ASCII.
tricky_text = st.lists(
    st.one_of(
        st.sampled_from(MARKERS + [m[:k] for m in MARKERS for k in (1, 3, 6)] + FRAGMENTS),
        st.text(alphabet="{}[]()\"'\\;:,<>/|=` \n\tabcxyzé日0", max_size=6),
    ),
    max_size=8,
).map("".join)

json_scalars = st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(
    allow_nan=False, allow_infinity=False
) | tricky_text  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
    max_leaves=6,
)
identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s)
)
arguments = st.dictionaries(identifiers, json_values, max_size=4)
call_lists = st.lists(st.tuples(identifiers, arguments), min_size=1, max_size=3)
# Content around calls: no whitespace at its edges (dropped next to calls) and no full
# marker (which would make it a call region of its own).
plain_text = (
    st.text(alphabet="abc xyz.,!?é<[{", max_size=12)
    .map(str.strip)
    .filter(lambda s: not any(m in s for m in MARKERS))
)
dumps_styles: st.SearchStrategy[dict[str, Any]] = st.sampled_from(
    [{}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}]
)


def expected_content(segments: list[str]) -> str:
    """The contract: text outside calls (segments[i] lies between call i-1 and call i),
    verbatim but for whitespace between a call and the start or end of the content."""
    filled = [i for i, text in enumerate(segments) if text.strip()]
    if not filled:
        return ""
    out = "".join(segments)
    out = out.lstrip() if filled[0] > 0 else out
    return out.rstrip() if filled[-1] < len(segments) - 1 else out


def canonical(args: dict[str, Any]) -> str:
    return json.dumps(args, separators=(",", ":"), ensure_ascii=False)


@st.composite
def outputs(draw: st.DrawFn, fmt: str) -> tuple[str, str, list[tuple[str, str]]]:
    """(model output, expected content, expected calls) for well-formed calls."""
    calls = draw(call_lists)
    style = draw(dumps_styles)
    expected = [(name, canonical(args)) for name, args in calls]
    if fmt == "pythonic":
        body = ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls)
        return draw(st.sampled_from(["", "\n", "<|python_start|>"])) + f"[{body}]", "", expected
    objects = [json.dumps({"name": n, "arguments": a}, **style) for n, a in calls]
    if fmt == "llama3_json":
        objects = [json.dumps({"name": n, "parameters": a}, **style) for n, a in calls]
        return (
            draw(st.sampled_from(["", "<|python_tag|>", " \n"])) + "; ".join(objects),
            "",
            expected,
        )
    texts = draw(st.lists(plain_text, min_size=len(calls) + 1, max_size=len(calls) + 1))
    if fmt == "mistral":
        array = json.dumps([{"name": n, "arguments": a} for n, a in calls], **style)
        segments = [texts[0] + " ", "\n" + texts[1]]
        return (
            "[TOOL_CALLS]".join([segments[0], array + segments[1]]),
            expected_content(segments),
            expected,
        )
    segments = [texts[0] + "\n"] + ["\n" + t + "\n" for t in texts[1:-1]] + ["\n" + texts[-1]]
    parts = [segments[0]]
    for obj, segment in zip(objects, segments[1:], strict=True):
        parts += [f"<tool_call>\n{obj}\n</tool_call>", segment]
    return "".join(parts), expected_content(segments), expected


def _property(fmt: str) -> Any:
    @SETTINGS
    @given(data=outputs(fmt), cuts=st.lists(st.integers(0, 10_000), max_size=12))
    def check(data: tuple[str, str, list[tuple[str, str]]], cuts: list[int]) -> None:
        text, content, calls = data
        assert calls_of(get_parser(fmt).parse(text)) == (content, calls)
        assert streamed(fmt, split(text, cuts)) == (content, calls)

    return check


test_hermes_calls_round_trip = _property("hermes")
test_llama3_json_calls_round_trip = _property("llama3_json")
test_mistral_calls_round_trip = _property("mistral")
test_pythonic_calls_round_trip = _property("pythonic")


@SETTINGS
@given(
    fmt=st.sampled_from(FORMATS),
    text=st.lists(st.one_of(tricky_text, st.sampled_from(MARKERS)), max_size=6).map("".join),
    cuts=st.lists(st.integers(0, 10_000), max_size=10),
)
def test_any_text_streams_like_the_one_shot_parse(fmt: str, text: str, cuts: list[int]) -> None:
    assert streamed(fmt, split(text, cuts)) == calls_of(get_parser(fmt).parse(text))


@SETTINGS
@given(
    fmt=st.sampled_from(FORMATS),
    text=st.lists(st.one_of(tricky_text, st.sampled_from(FRAGMENTS)), max_size=6).map("".join),
    cuts=st.lists(st.integers(0, 10_000), max_size=10),
)
def test_with_tools_any_text_streams_like_the_one_shot_parse(
    fmt: str, text: str, cuts: list[int]
) -> None:
    one_shot = calls_of(get_parser(fmt).parse(text, accept=declared))
    assert streamed(fmt, split(text, cuts), declared) == one_shot


@SETTINGS
@given(fmt=st.sampled_from(FORMATS), text=tricky_text, tools=st.booleans())
def test_text_without_calls_comes_back_exactly(fmt: str, text: str, tools: bool) -> None:
    content, calls = get_parser(fmt).parse(text, accept=declared if tools else None)
    assert calls or content == text


def check_between_texts(
    fmt: str, calls: list[tuple[str, dict[str, Any]]], body: str, texts: list[str], cuts: list[int]
) -> None:
    """The calls written as `body`, with text before and after, parse back exactly."""
    text = texts[0] + " " + body + "\n" + texts[1]
    content = expected_content([texts[0] + " ", "\n" + texts[1]])
    expected = (content, [(n, canonical(a)) for n, a in calls])
    assert calls_of(get_parser(fmt).parse(text)) == expected
    assert streamed(fmt, split(text, cuts)) == expected


@SETTINGS
@given(
    calls=call_lists,
    texts=st.lists(plain_text, min_size=2, max_size=2),
    args_marker=st.booleans(),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_mistral_v11_calls_round_trip(
    calls: list[tuple[str, dict[str, Any]]], texts: list[str], args_marker: bool, cuts: list[int]
) -> None:
    between = "[ARGS]" if args_marker else ""
    body = "".join(f"[TOOL_CALLS]{n}{between}{json.dumps(a)}" for n, a in calls)
    check_between_texts("mistral", calls, body, texts, cuts)


@SETTINGS
@given(
    calls=call_lists,
    # Prose before the calls has no "{": a value it opened would hold the calls in it.
    texts=st.lists(plain_text.filter(lambda s: "{" not in s), min_size=2, max_size=2),
    separator=st.sampled_from(["; ", "\n", "<|python_tag|>", " ;\n<|python_tag|>"]),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_llama3_calls_after_prose_round_trip(
    calls: list[tuple[str, dict[str, Any]]], texts: list[str], separator: str, cuts: list[int]
) -> None:
    body = separator.join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    check_between_texts("llama3_json", calls, body, texts, cuts)
