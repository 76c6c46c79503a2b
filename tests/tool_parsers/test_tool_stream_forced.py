"""Forced tool calls stream call by call: each call is emitted when its object closes, and the
deltas (calls, and the content of what is not a call) are the same however the text is cut."""

from __future__ import annotations

import itertools
import json

import pytest

from mmserve.frontend.tool_stream import ForcedCallStream
from mmserve.frontend.tools import ToolRequest, ToolSpec
from mmserve.processors.tool_parsers import ContentDelta, ToolCallDelta

WEATHER = {"name": "get_weather", "arguments": {"city": 'Oslo, "NO" }{', "days": 2}}
CLOSED = {"name": "is_open", "arguments": {"place": "x"}}
CASES = {
    "array": json.dumps([WEATHER, CLOSED]),
    "object": json.dumps(WEATHER),
    "spaced": "  [ " + json.dumps(CLOSED) + " ,\n " + json.dumps(WEATHER) + " ]  ",
    "cut": json.dumps([WEATHER, CLOSED])[:-12],  # max_tokens inside the second call
    "not calls": json.dumps([{"nom": 1}]),
    "junk after": json.dumps(WEATHER) + " and more",
}


def ids() -> itertools.count:  # type: ignore[type-arg]
    return itertools.count()


def run(chunks: list[str]) -> list[object]:
    counter = ids()
    stream = ForcedCallStream(new_id=lambda: f"call_{next(counter)}")
    out: list[object] = []
    for chunk in chunks:
        out += stream.feed(chunk)
    return out + stream.finish()


def merged(deltas: list[object]) -> list[object]:
    """Adjacent content deltas joined (content may arrive in any number of pieces)."""
    out: list[object] = []
    for d in deltas:
        if isinstance(d, ContentDelta) and out and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + d.text)
        else:
            out.append(d)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_split_gives_the_one_shot_deltas(name: str) -> None:
    text = CASES[name]
    want = merged(run([text]))
    for i in range(len(text) + 1):
        assert merged(run([text[:i], text[i:]])) == want, i
    assert merged(run(list(text))) == want  # one character at a time


def test_calls_come_as_their_objects_close() -> None:
    text = CASES["array"]
    first_end = text.index("}}") + 2
    stream = ForcedCallStream(new_id=lambda: "call_0")
    early = stream.feed(text[:first_end])
    assert [type(d) for d in early] == [ToolCallDelta] and early[0].name == "get_weather"
    rest = stream.feed(text[first_end:]) + stream.finish()
    assert [d.name for d in rest if isinstance(d, ToolCallDelta)] == ["is_open"]


def test_what_is_not_a_call_stays_content() -> None:
    cut = merged(run([CASES["cut"]]))
    assert isinstance(cut[0], ToolCallDelta) and isinstance(cut[-1], ContentDelta)
    assert merged(run([CASES["not calls"]])) == [ContentDelta(CASES["not calls"])]
    tail = merged(run([CASES["junk after"]]))
    assert isinstance(tail[0], ToolCallDelta) and tail[-1] == ContentDelta("and more")


BIG = '{"x":236245896745012E6729,"y":[-1e999,1.5],"n":' + "9" * 5000 + ',"s":"1E400"}'


@pytest.mark.parametrize(
    "output", ['{"name":"f","arguments":' + BIG + "}", f'[{{"name":"f","arguments":{BIG}}}]']
)
def test_numbers_beyond_floats_range_are_arguments_as_written(output: str) -> None:
    """JSON numbers have no range and a grammar for "type": "number" lets 1E400 through: the
    call is still a call (it was content, with finish reason stop), its number kept as
    written, not "Infinity" (not JSON)."""
    calls = run([output])
    assert calls == [ToolCallDelta(0, "call_0", "f", BIG)]
    assert json.loads(BIG.replace("9" * 5000, "9"))["x"] == float("inf")  # Python's reading


def test_strict_tools_refuse_arguments_that_cannot_be_checked() -> None:
    tool = ToolSpec("f", {"type": "object", "properties": {"n": {"type": "integer"}}}, True, "t")
    accept = ToolRequest((tool,), "required").accept()
    assert accept("f", '{"n":12}') and not accept("f", '{"n":1.5}')
    assert not accept("f", '{"n":' + "9" * 5000 + "}")  # past int's digit limit: no crash
