"""The model outputs of vLLM's and SGLang's reasoning-parser unit tests, ported to ours: the
thought and the answer, one-shot and split anywhere in three, and (vLLM's is_reasoning_end)
whether the thought ended, on token ids.

Where a peer expects something else by design, the expectation is ours and a comment says
why. The differences that recur (base.py's contract):
- STRIP: the answer's leading whitespace after `</think>` is dropped (vLLM keeps "\\n").
- STATE: whether an output starts inside a thought is told by the prompt (gate.find_state:
  THOUGHT after a template that opened `<think>`), not guessed from the output. vLLM's
  qwen3 parser reads `...</think>answer` as a thought for Qwen3-Thinking models; here those
  models' prompts end in `<think>`, so the output starts in THOUGHT.
- CUT: an output that ends inside its thought is all thought, streamed or not (vLLM's qwen3
  gives such an output as content when not streaming, as thought when streaming).
vLLM's None (no part) is "" here.

Sources (stored snapshots of the peers' repositories):
- VLLM_R1 = vllm tests/reasoning/test_deepseekr1_reasoning_parser.py
- VLLM_QWEN3 = vllm tests/reasoning/test_qwen3_reasoning_parser.py
- VLLM_HERMES = vllm tests/entrypoints/openai/tool_parsers/test_hermes_tool_parser.py
- SGL = sglang test/srt/test_reasoning_parser.py
"""

from __future__ import annotations

import itertools

import pytest

from mmserve.processors.reasoning_parsers import (
    ANSWER,
    OPEN,
    THOUGHT,
    ReasoningGate,
    ThinkTracker,
    get_reasoning_parser,
)
from mmserve.processors.tool_parsers import get_parser
from mmserve.processors.tool_parsers.base import collect
from tests.reasoning_parsers.test_reasoning_parsers import streamed

R = "This is a reasoning section"

# (parser, start state, output, thought, answer, whether the thought ended)
CASES = [
    # VLLM_R1 SIMPLE_REASONING, COMPLETE_REASONING, NO_CONTENT / NO_REASONING_STREAMING
    ("deepseek_r1", OPEN, f"{R}</think>This is the rest", R, "This is the rest", True),
    ("deepseek_r1", OPEN, f"{R}</think>", R, "", True),
    ("deepseek_r1", OPEN, "This is content", "This is content", "", False),
    # VLLM_R1 MULTIPLE_LINES, SHORTEST_REASONING(_NO_STREAMING)
    ("deepseek_r1", OPEN, "This\nThat</think>This is the rest\nThat", "This\nThat",
     "This is the rest\nThat", True),
    ("deepseek_r1", OPEN, "</think>This is the rest", "", "This is the rest", True),
    # VLLM_R1 REASONING_WITH_THINK, COMPLETE_REASONING_WITH_THINK, MULTIPLE_LINES_WITH_THINK
    ("deepseek_r1", OPEN, f"<think>{R}</think>This is the rest", R, "This is the rest", True),
    ("deepseek_r1", OPEN, f"<think>{R}</think>", R, "", True),
    ("deepseek_r1", OPEN, "<think>This\nThat</think>This is the rest\nThat", "This\nThat",
     "This is the rest\nThat", True),
    # VLLM_R1 THINK_NO_END, EMPTY(_STREAMING)
    ("deepseek_r1", OPEN, f"<think>{R}", R, "", False),
    ("deepseek_r1", OPEN, "", "", "", False),
    # VLLM_R1 NEW_LINE ("\nThis is the rest"; its streaming variant also puts the "\n" before
    # <think> into the thought). STRIP: the answer starts at "This".
    ("deepseek_r1", OPEN, f"\n<think>{R}</think>\nThis is the rest", R, "This is the rest",
     True),
    # The same outputs after a template that opened the thought (DeepSeek-R1's newer
    # templates end the prompt in `<think>\n`): the same split.
    ("deepseek_r1", THOUGHT, f"{R}</think>This is the rest", R, "This is the rest", True),
    ("deepseek_r1", THOUGHT, "This is content", "This is content", "", False),
    # VLLM_QWEN3 WITH_THINK(_STREAM), WITHOUT_THINK(_STREAM), COMPLETE_REASONING,
    # MULTILINE_REASONING
    ("qwen3", OPEN, f"<think>{R}</think>This is the rest", R, "This is the rest", True),
    ("qwen3", OPEN, "This is the rest", "", "This is the rest", True),
    ("qwen3", OPEN, f"<think>{R}</think>", R, "", True),
    ("qwen3", OPEN, "<think>This is a reasoning\nsection</think>This is the rest\nThat",
     "This is a reasoning\nsection", "This is the rest\nThat", True),
    # VLLM_QWEN3 ONLY_OPEN_TAG (vLLM: content "<think>This is ..." one-shot) and
    # ONLY_OPEN_TAG_STREAM (thought). CUT: all thought, both ways.
    ("qwen3", OPEN, f"<think>{R}", R, "", False),
    # VLLM_QWEN3 PREFIX_FORMAT(_COMPLETE, _MULTILINE). STATE: the prompt opened the thought.
    ("qwen3", THOUGHT, f"{R}</think>This is the rest", R, "This is the rest", True),
    ("qwen3", THOUGHT, f"{R}</think>", R, "", True),
    ("qwen3", THOUGHT, "This is a reasoning\nsection</think>This is the rest\nThat",
     "This is a reasoning\nsection", "This is the rest\nThat", True),
    # ... and without a thought-opening prompt, such an output is an answer (a stray
    # `</think>` in it included): qwen3 thinks only when its template asks.
    ("qwen3", OPEN, f"{R}</think>This is the rest", "", f"{R}</think>This is the rest", True),
    # SGL TestBaseReasoningFormatDetector / TestQwen3Detector / TestOlmo3Detector
    ("qwen3", OPEN, "This is normal text", "", "This is normal text", True),
    ("qwen3", OPEN, "<think>This is reasoning", "This is reasoning", "", False),
    ("qwen3", OPEN, "<think>This is reasoning</think>This is normal", "This is reasoning",
     "This is normal", True),
    ("qwen3", OPEN, "<think>reasoning</think>normal", "reasoning", "normal", True),
    ("qwen3", OPEN, "<think>Let me think about this problem</think>The answer is 42.",
     "Let me think about this problem", "The answer is 42.", True),
    ("qwen3", OPEN, "Direct answer without thinking.", "", "Direct answer without thinking.",
     True),
    ("qwen3", OPEN, "<think>Thinking...</think>Answer.", "Thinking...", "Answer.", True),
    # SGL test_detect_and_parse_force_reasoning, TestQwen3ForcedReasoningDetector (forced
    # reasoning = the prompt opened the thought: THOUGHT)
    ("qwen3", THOUGHT, "This should be reasoning", "This should be reasoning", "", False),
    ("qwen3", THOUGHT, "I need to think about this step by step.</think>The answer is 42.",
     "I need to think about this step by step.", "The answer is 42.", True),
    # SGL TestQwen3ForcedReasoningDetector.test_detect_and_parse_with_start_token: the model
    # opens the thought again although the prompt did; the marker is not thought.
    ("qwen3", THOUGHT, "<think>I need to think about this.</think>The answer is 42.",
     "I need to think about this.", "The answer is 42.", True),
    # SGL TestDeepSeekR1Detector (force_reasoning: deepseek_r1 thinks without markers)
    ("deepseek_r1", OPEN, "I need to think about this. The answer is 42.",
     "I need to think about this. The answer is 42.", "", False),
    ("deepseek_r1", OPEN, "I think this is the answer</think>The final answer is 42.",
     "I think this is the answer", "The final answer is 42.", True),
    # SGL test_detect_and_parse_with_start_token (DeepSeek-R1-0528 writes `<think>`), after a
    # prompt that did not open the thought and after one that did
    ("deepseek_r1", OPEN, "<think>I need to think about this.</think>The answer is 42.",
     "I need to think about this.", "The answer is 42.", True),
    ("deepseek_r1", THOUGHT, "<think>I need to think about this.</think>The answer is 42.",
     "I need to think about this.", "The answer is 42.", True),
]  # fmt: skip


@pytest.mark.parametrize(("name", "state", "text", "thought", "answer", "ended"), CASES)
def test_peer_case_at_every_split(
    name: str, state: str, text: str, thought: str, answer: str, ended: bool
) -> None:
    assert get_reasoning_parser(name).parse(text, state) == (thought, answer)
    assert streamed(name, state, list(text)) == (thought, answer)
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert streamed(name, state, [text[:i], text[i:j], text[j:]]) == (thought, answer)


START_ID, END_ID = 8, 9  # `<think>` and `</think>` are single added tokens in these models


def token_ids(text: str) -> list[int]:
    """A stand-in tokenisation: the markers one token each, every other character one."""
    ids: list[int] = []
    for i, part in enumerate(text.replace("</think>", "\0").split("<think>")):
        ids += [START_ID] if i else []
        ids += [END_ID if c == "\0" else 1 for c in part]
    return ids


@pytest.mark.parametrize(("name", "state", "text", "thought", "answer", "ended"), CASES)
def test_peer_case_thought_end_on_tokens(
    name: str, state: str, text: str, thought: str, answer: str, ended: bool
) -> None:
    """VLLM_R1 is_reasoning_end: whether the output is past its thought (qwen3: an output
    that opens none is an answer from its start)."""
    default = get_reasoning_parser(name).open_default
    tracker = ThinkTracker(ReasoningGate(state, (START_ID,), (END_ID,), default))
    for token in token_ids(text):
        tracker.feed(token)
    assert (tracker.state == ANSWER) == ended


# VLLM_HERMES test_tool_call_no_stream: QwQ-32B's output, its thought (the prompt opened it)
# then a call. With the reasoning parser in front, the thought is apart and the call is read
# from the answer, which is then only the call.
QWQ = (
    "好的，用户现在要研发一个5MW的燃气轮机，需要确定总体参数。\n\n总结下来，给出一个范例参数。\n"
    '</think>\n\n<tool_call>\n{"name": "internet_search", "arguments": {"question": '
    '"5MW燃气轮机设计参数 空气流量"}}\n</tool_call>\n\n '
)


def test_thought_then_hermes_call() -> None:
    for chunks in [[QWQ], list(QWQ)] + [[QWQ[:i], QWQ[i:]] for i in range(len(QWQ) + 1)]:
        split = get_reasoning_parser("qwen3").stream(THOUGHT)
        tools = get_parser("hermes").stream()
        thoughts, deltas = [], []
        for chunk in [*chunks, None]:
            thought, answer = split.feed(chunk) if chunk is not None else split.finish()
            thoughts.append(thought)
            deltas += tools.feed(answer)
        content, calls = collect(deltas + tools.finish())
        assert "".join(thoughts) == QWQ[: QWQ.index("</think>")]
        assert content == ""
        assert [(c.name, c.arguments) for c in calls] == [
            ("internet_search", '{"question":"5MW燃气轮机设计参数 空气流量"}')
        ]
