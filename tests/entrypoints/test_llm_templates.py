"""LLM.chat and chat templates: continue_final_message prompts are transformers' (Qwen2.5's
template on a tiny model), its conditions are named, and the offline front end bounds a
template's render as the server does."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mmserve import LLM, SamplingParams
from mmserve.config import DEFAULT_TEMPLATE_TIMEOUT_MS
from mmserve.errors import InvalidArgument
from tests.utils.chat_templates import QWEN25_TEMPLATE
from tests.utils.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PARTIAL = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello world, this is"},
]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("llm-templates"), "qwen2", seed=3)
    (folder / "chat_template.jinja").write_text(QWEN25_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def llm(qwen: Path) -> LLM:
    return LLM(str(qwen), num_kv_blocks=64)


def test_continue_final_message_prompt_is_transformers(llm: LLM, qwen: Path) -> None:
    out = llm.chat(
        PARTIAL, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False
    )[0]
    expected = AutoTokenizer.from_pretrained(qwen).apply_chat_template(
        PARTIAL, continue_final_message=True, tokenize=True, return_dict=False,
        sanitize_control_tokens=True,
    )
    assert out.prompt_token_ids == list(expected)
    assert llm.tokenizer.decode(out.prompt_token_ids).endswith("assistant\nHello world, this is")
    direct = llm.generate([list(expected)], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_continue_final_message_conditions_are_named(llm: LLM) -> None:
    for messages, options in [
        (PARTIAL, {}),  # add_generation_prompt is true by default: it opens a new turn
        (PARTIAL[:1], {"add_generation_prompt": False}),  # the last message is the user's
    ]:
        with pytest.raises(InvalidArgument) as err:
            llm.chat(messages, GREEDY, continue_final_message=True, use_tqdm=False, **options)
        assert err.value.field == "continue_final_message"


def test_offline_template_budget(llm: LLM) -> None:
    assert llm.frontend.template_timeout_ms == DEFAULT_TEMPLATE_TIMEOUT_MS  # the server's default
    tokenizer = llm.frontend.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"
    )
    llm.frontend.template_timeout_ms = 200
    try:
        with pytest.raises(InvalidArgument) as err:
            llm.chat(PARTIAL[:1], GREEDY, use_tqdm=False)
    finally:
        tokenizer.chat_template = template
        llm.frontend.template_timeout_ms = DEFAULT_TEMPLATE_TIMEOUT_MS
    assert str(err.value) == "chat: the model's chat template did not finish within 200 ms"
