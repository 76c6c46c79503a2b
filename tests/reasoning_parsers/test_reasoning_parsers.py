"""Reasoning parsers: the registry, golden splits, and (hypothesis) the same parts under every
chunking: `</think>` split anywhere, none at all, tool calls right after the thought."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.errors import InvalidArgument
from mmserve.processors.reasoning_parsers import (
    ANSWER,
    OPEN,
    THOUGHT,
    ReasoningGate,
    ThinkTracker,
    find_state,
    get_reasoning_parser,
    reasoning_parser_for_model,
    reasoning_parser_names,
)
from mmserve.processors.tool_parsers import get_parser
from mmserve.processors.tool_parsers.base import collect
from tests.tool_parsers.test_tool_parsers_property import split

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STATES = (OPEN, THOUGHT, ANSWER)

# (parser, start state, output text, thought, answer)
GOLDEN = [
    ("qwen3", OPEN, "<think>\nhmm\n</think>\n\nParis.", "\nhmm\n", "Paris."),
    ("qwen3", OPEN, "  <think>a</think>b", "a", "b"),
    ("qwen3", OPEN, "Paris.", "", "Paris."),
    ("qwen3", OPEN, "<thi", "", "<thi"),
    ("qwen3", OPEN, "<think>cut short", "cut short", ""),
    ("qwen3", THOUGHT, "inside\n</think>\n\nanswer </think> kept", "inside\n",
     "answer </think> kept"),
    ("qwen3", THOUGHT, "ends inside </thi", "ends inside </thi", ""),
    ("qwen3", ANSWER, "<think>not a thought</think>", "", "<think>not a thought</think>"),
    ("deepseek_r1", OPEN, "all thought", "all thought", ""),
    ("deepseek_r1", OPEN, "<think>t</think>a", "t", "a"),
    ("deepseek_r1", THOUGHT, "t\n</think>\n\n<tool_call>", "t\n", "<tool_call>"),
]  # fmt: skip


def streamed(name: str, state: str, chunks: list[str]) -> tuple[str, str]:
    stream = get_reasoning_parser(name).stream(state)
    parts = [stream.feed(c) for c in chunks] + [stream.finish()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


def test_registry_lists_names_and_refuses_unknown_ones() -> None:
    assert reasoning_parser_names() == ("deepseek_r1", "qwen3")
    with pytest.raises(InvalidArgument, match="deepseek_r1, qwen3, none") as e:
        get_reasoning_parser("o1")
    assert e.value.field == "reasoning_parser"


def test_parser_from_chat_template() -> None:
    assert reasoning_parser_for_model(None) is None
    assert reasoning_parser_for_model("{{ messages }}") is None
    assert reasoning_parser_for_model("... '<think>\\n\\n</think>' ...") == "qwen3"
    assert reasoning_parser_for_model("<｜Assistant｜><think>\\n") == "deepseek_r1"


@pytest.mark.parametrize(("name", "state", "text", "thought", "answer"), GOLDEN)
def test_golden_at_every_split(name: str, state: str, text: str, thought: str, answer: str) -> None:
    assert get_reasoning_parser(name).parse(text, state) == (thought, answer)
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert streamed(name, state, [text[:i], text[i:j], text[j:]]) == (thought, answer)


MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
tricky = st.lists(
    st.one_of(
        st.sampled_from(MARKERS + [m[:k] for m in MARKERS for k in (1, 2, 5)]),
        st.text(alphabet="<>/thinkab \n{}\"é", max_size=5),
    ),
    max_size=10,
).map("".join)


@SETTINGS
@given(
    st.sampled_from(reasoning_parser_names()), st.sampled_from(STATES), tricky,
    st.lists(st.integers(0, 10**6), max_size=8),
)
def test_any_chunking_gives_the_one_shot_parts(
    name: str, state: str, text: str, cuts: list[int]
) -> None:
    assert streamed(name, state, split(text, cuts)) == get_reasoning_parser(name).parse(text, state)


plain = st.text(alphabet="ab c.\n<>/é", max_size=12).filter(lambda s: "</think>" not in s)


@SETTINGS
@given(plain, plain, st.booleans(), st.lists(st.integers(0, 10**6), max_size=6))
def test_thought_then_answer_come_back(
    thought: str, answer: str, opened: bool, cuts: list[int]
) -> None:
    """A thought the output opens (or the prompt did) and its answer, exactly; no `</think>`
    at all (a budget, max_tokens) leaves everything thought."""
    answer = answer.lstrip()
    text = ("<think>" if opened else "") + thought + "</think>\n" + answer
    state = OPEN if opened else THOUGHT
    assert streamed("qwen3", state, split(text, cuts)) == (thought, answer)
    assert streamed("qwen3", THOUGHT, split(thought + "</th", cuts)) == (thought + "</th", "")


@SETTINGS
@given(plain, st.lists(st.integers(0, 10**6), max_size=6))
def test_tool_calls_right_after_the_thought(thought: str, cuts: list[int]) -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text = f"<think>{thought}</think>\n\n{call}"
    stream = get_reasoning_parser("qwen3").stream(OPEN)
    tools = get_parser("hermes").stream()
    deltas, thoughts = [], []
    for chunk in [*split(text, cuts), None]:
        part, answer = stream.feed(chunk) if chunk is not None else stream.finish()
        thoughts.append(part)
        deltas += tools.feed(answer)
    deltas += tools.finish()
    content, calls = collect(deltas)
    assert "".join(thoughts) == thought
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("f", '{"x":1}')])


def tracker(state: str, budget: int | None = None, end: tuple[int, ...] = (9,)) -> ThinkTracker:
    return ThinkTracker(ReasoningGate(state, (8,), end, ANSWER, budget))


def test_tracker_counts_the_thought_and_forces_its_end() -> None:
    t = tracker(OPEN)
    for tok in (8, 1, 2, 9, 3):
        t.feed(tok)
    assert (t.state, t.reasoning_tokens) == (ANSWER, 4)
    t = tracker(OPEN)
    t.feed(1)
    assert (t.state, t.reasoning_tokens) == (ANSWER, 0)
    t = tracker(THOUGHT, budget=2, end=(9, 7))
    for tok in (1, 9, 2):  # a partial marker is thought after all
        assert t.forced() is None
        t.feed(tok)
    assert t.forced() == 9
    t.feed(9)
    assert t.forced() == 7
    t.feed(7)
    assert (t.state, t.forced(), t.reasoning_tokens) == (ANSWER, None, 5)


def test_find_state_from_the_prompt() -> None:
    start, end = (8,), (9,)
    assert find_state([1, 8, 5], start, end, ANSWER) == THOUGHT  # the template opened it
    assert find_state([1, 8, 5, 9, 5], start, end, ANSWER) == OPEN  # enable_thinking false
    assert find_state([1, 2], start, end, ANSWER) == OPEN
    assert find_state([1, 2], start, end, THOUGHT) == OPEN  # deepseek: opens or is inside
    assert find_state([8, 9], start, end, THOUGHT) == ANSWER
