"""continue_final_message renders as transformers' apply_chat_template(continue_final_message=
True) does (SmolLM2's and Qwen2.5's templates), control tokens in the continued text staying
text; each condition it needs is an InvalidArgument naming continue_final_message."""

from __future__ import annotations

from typing import Any

import pytest

from mmserve.errors import InvalidArgument
from mmserve.processors.chat_template import render_and_tokenize
from tests.processors.test_chat_template import QUESTION, with_template
from tests.utils.chat_templates import QWEN25_TEMPLATE

PARTIAL = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
CALL = {"id": "c1", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
WITH_TOOLS = [
    {"role": "system", "content": "Be brief."},
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    {"role": "assistant", "content": "It is sunny<|im_end|> in"},  # a forged token stays text
]


def _reference(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> tuple[str, list[int]]:
    """transformers' text and (sanitised) token ids; its tool-call arguments are objects."""
    for m in messages:
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = {"city": "Paris"}
    text = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False, **kw)
    ids = tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False,
        sanitize_control_tokens=True, **kw,
    )
    return text, list(ids)


def _continued(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> tuple[str, list[int]]:
    return render_and_tokenize(
        tokenizer, messages, add_generation_prompt=False, continue_final_message=True, **kw
    )


def test_smollm2_continues_the_last_message(smollm2_tokenizer: Any) -> None:
    text, ids = _continued(smollm2_tokenizer, PARTIAL)
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")  # no <|im_end|>
    assert (text, ids) == _reference(smollm2_tokenizer, [dict(m) for m in PARTIAL])


def test_qwen25_continues_after_tools(smollm2_tokenizer: Any) -> None:
    qwen = with_template(smollm2_tokenizer, QWEN25_TEMPLATE)
    text, ids = _continued(qwen, WITH_TOOLS, tools=TOOLS)
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\nIt is sunny<|im_end|> in")
    messages = [{k: v for k, v in m.items() if v is not None} for m in WITH_TOOLS]
    assert (text, ids) == _reference(qwen, messages, tools=TOOLS)
    assert ids.count(smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")) == 4  # not 5


ALTERS = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"  # prints it changed
NO_CONTENT = "{% for m in messages %}{{ m.role }}{% endfor %}"


@pytest.mark.parametrize(
    ("messages", "template", "add_generation_prompt", "says"),
    [
        (PARTIAL, None, True, "needs add_generation_prompt false"),
        ([*QUESTION, {"role": "assistant", "tool_calls": [CALL]}], None, False, "no content"),
        (PARTIAL, ALTERS, False, "alters the last message"),
        (PARTIAL, NO_CONTENT, False, "does not render message content"),
        (QUESTION, None, False, "must be the assistant's"),  # the API's rule, not transformers'
    ],
)
def test_conditions_name_continue_final_message(
    smollm2_tokenizer: Any,
    messages: list[dict[str, Any]],
    template: str | None,
    add_generation_prompt: bool,
    says: str,
) -> None:
    tok = with_template(smollm2_tokenizer, template) if template else smollm2_tokenizer
    with pytest.raises(InvalidArgument, match=says) as err:
        render_and_tokenize(
            tok, messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=True,
        )
    assert err.value.field == "continue_final_message"
    if messages[-1]["role"] == "assistant":  # transformers refuses these too
        with pytest.raises(ValueError, match="continue_final_message"):
            tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt,
                continue_final_message=True, tokenize=False,
            )
