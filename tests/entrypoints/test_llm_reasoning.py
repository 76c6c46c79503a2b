"""The offline API on reasoning models, as the server serves them: reasoning_budget forces
`</think>` (tiny random Qwen3 of tests/server/test_server_reasoning.py), and a model without
a reasoning format refuses a budget instead of ignoring it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidArgument
from tests.server.test_server_reasoning import ASK, _model
from tests.utils.chat_templates import QWEN3_TEMPLATE

SETTINGS = {"device": "cpu", "dtype": "float32", "block_size": 4, "num_kv_blocks": 128}


def test_budget_forces_the_end_of_the_thought(tmp_path: Path) -> None:
    with LLM(str(_model(tmp_path, "qwen3", QWEN3_TEMPLATE)), **SETTINGS) as llm:
        start, end = llm.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
        params = SamplingParams(max_tokens=12, seed=2, logit_bias={start: 100.0}, reasoning_budget=3)
        (out,) = llm.chat(ASK, params, use_tqdm=False)
        # `<think>`, 3 thinking tokens, then `</think>` forced over the bias
        assert out.outputs[0].token_ids[:5] == [start, start, start, start, end]


def test_budget_without_a_reasoning_format_is_refused(tmp_path: Path) -> None:
    with LLM(str(_model(tmp_path, "plain", None)), **SETTINGS) as llm:
        with pytest.raises(InvalidArgument) as e:
            llm.generate("Hi", SamplingParams(max_tokens=4, reasoning_budget=2), use_tqdm=False)
        assert e.value.field == "reasoning_budget"


def test_chat_template_kwargs_is_vllms_name_for_template_kwargs(tmp_path: Path) -> None:
    """enable_thinking=False reaches the template under either name (the prompt gains Qwen3's
    empty thought), and giving both is a TypeError."""
    with LLM(str(_model(tmp_path, "qwen3", QWEN3_TEMPLATE)), **SETTINGS) as llm:
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def prompt(**kw: object) -> list[int]:
            return llm.chat(ASK, params, use_tqdm=False, **kw)[0].prompt_token_ids  # type: ignore[arg-type]

        off = {"enable_thinking": False}
        thinking, plain = prompt(), prompt(template_kwargs=off)
        assert plain != thinking and prompt(chat_template_kwargs=off) == plain
        with pytest.raises(TypeError, match="not both"):
            prompt(template_kwargs=off, chat_template_kwargs=off)
