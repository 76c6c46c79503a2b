"""LLM.chat and chat templates: the offline front end bounds a template's render as the server
does."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config import DEFAULT_TEMPLATE_TIMEOUT_MS
from mmserve.errors import InvalidArgument
from tests.utils.chat_templates import QWEN25_TEMPLATE
from tests.utils.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("llm-templates"), "qwen2", seed=3)
    (folder / "chat_template.jinja").write_text(QWEN25_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def llm(qwen: Path) -> LLM:
    return LLM(str(qwen), num_kv_blocks=64)


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
            llm.chat(HELLO, GREEDY, use_tqdm=False)
    finally:
        tokenizer.chat_template = template
        llm.frontend.template_timeout_ms = DEFAULT_TEMPLATE_TIMEOUT_MS
    assert str(err.value) == "chat: the model's chat template did not finish within 200 ms"
