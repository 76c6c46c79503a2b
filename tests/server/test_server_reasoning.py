"""Reasoning models end to end, on a tiny random Qwen3 with Qwen3's chat template and its
`<think>` / `</think>` added tokens: the thought streams as reasoning_text apart from the
answer, reasoning_budget forces `</think>`, and a grammar (a `choice`, a forced tool call)
constrains only the answer. The model's free output is noise; logit_bias opens its thought."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from mmserve.processors.reasoning_parsers import OPEN, THOUGHT, get_reasoning_parser
from mmserve.processors.tool_parsers import get_parser  # noqa: F401 - the registry loads
from mmserve.server.config import ModelSpec
from mmserve_client import Client, MMServeError
from tests.server.conftest import ServerThread, serve
from tests.utils.chat_templates import QWEN3_TEMPLATE, QWEN3_THINKING_TEMPLATE
from tests.utils.tiny_models import make_tiny_model, make_tiny_tokenizer

ASK = [{"role": "user", "content": "Capital of France?"}]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "is_open", "description": "is it open",
    "parameters": {"type": "object", "properties": {"open": {"type": "boolean"}},
                   "required": ["open"]},
}}]  # fmt: skip


def _model(root: Path, name: str, template: str | None) -> Path:
    path = make_tiny_model(root, arch="qwen3", seed=5, name=name, max_position_embeddings=2048)
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens(ADDED)  # not special: they stay in the text, as in Qwen3
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("reasoning")
    s = serve([
        ModelSpec("qwen3", str(_model(root, "qwen3", QWEN3_TEMPLATE))),
        ModelSpec("thinking", str(_model(root, "thinking", QWEN3_THINKING_TEMPLATE))),
        ModelSpec("plain", str(_model(root, "plain", None))),
    ])
    yield s
    s.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target, timeout=60) as c:
        yield c


def ids(server: ServerThread, model: str = "qwen3") -> tuple[int, int]:
    tok = server.handle(model).tokenizer
    return tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")


def one_shot(server: ServerThread, model: str, token_ids: tuple[int, ...], state: str) -> Any:
    text = server.handle(model).tokenizer.decode(list(token_ids), skip_special_tokens=True)
    return get_reasoning_parser("qwen3").parse(text, state)


def test_prompt_matches_transformers(server: ServerThread) -> None:
    tok = server.handle("qwen3").tokenizer
    for thinking in (True, False):
        want = tok.apply_chat_template(
            ASK, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        got = server.handle("qwen3").frontend.render_chat(_chat(thinking)).text
        assert got == want
        assert want.endswith("<|im_start|>assistant\n" + ("" if thinking else
                                                          "<think>\n\n</think>\n\n"))


def _chat(thinking: bool) -> Any:
    from mmserve.frontend.chat import ChatInput

    return ChatInput(messages=list(ASK), template_kwargs={"enable_thinking": thinking})


@pytest.mark.parametrize("model", ["qwen3", "thinking"])
def test_stream_splits_thought_and_answer(
    server: ServerThread, client: Client, model: str
) -> None:
    start, end = ids(server, model)
    bias = {start: 100.0} if model == "qwen3" else {end: 3.0}
    kw: dict[str, Any] = {"model": model, "max_tokens": 24, "seed": 1, "logit_bias": bias}
    chunks = list(client.chat_stream(ASK, **kw))
    tokens = tuple(t for c in chunks for t in c.token_ids)
    state = OPEN if model == "qwen3" else THOUGHT
    thought, answer = one_shot(server, model, tokens, state)
    assert "".join(c.reasoning_text for c in chunks) == thought
    assert "".join(c.text for c in chunks) == answer
    result = client.chat(ASK, **kw)
    assert (result.reasoning_text, result.text) == (thought, answer)
    assert result.usage is not None and 0 < result.usage.reasoning_tokens <= len(tokens)


def test_budget_forces_the_end_and_the_grammar_takes_the_answer(
    server: ServerThread, client: Client
) -> None:
    start, end = ids(server)
    kw: dict[str, Any] = {"model": "qwen3", "max_tokens": 40, "seed": 2, "logit_bias": {start: 100.0},
                          "reasoning_budget": 3, "choice": ["Paris", "Lyon"]}  # fmt: skip
    result = client.chat(ASK, **kw)
    assert result.token_ids[0] == start and result.token_ids[4] == end
    assert result.text in ("Paris", "Lyon")
    assert result.usage is not None and result.usage.reasoning_tokens == 5
    assert result.finish_reason == "stop"
    chunks = list(client.chat_stream(ASK, **kw))
    assert "".join(c.text for c in chunks) == result.text
    assert "".join(c.reasoning_text for c in chunks) == result.reasoning_text


def test_template_opened_thought_and_forced_tool_call(client: Client, server: ServerThread) -> None:
    _, end = ids(server, "thinking")
    tok = server.handle("thinking").tokenizer
    no_padding = {i: -100.0 for i in range(len(tok)) if not tok.decode([i]).strip()
                  or "," in tok.decode([i])}  # fmt: skip - a random model pads JSON otherwise
    kw: dict[str, Any] = {"model": "thinking", "max_tokens": 60, "seed": 3, "temperature": 0,
                          "reasoning_budget": 0, "tools": TOOLS, "tool_choice": "required",
                          "logit_bias": no_padding}  # fmt: skip
    result = client.chat(ASK, **kw)
    assert result.token_ids[0] == end and result.reasoning_text == ""
    assert [c.name for c in result.tool_calls] == ["is_open"], (result.text, result.finish_reason)
    assert result.finish_reason == "tool_calls" and result.text == ""
    assert result.usage is not None and result.usage.reasoning_tokens == 1


def test_no_budget_without_a_reasoning_format(client: Client) -> None:
    with pytest.raises(MMServeError) as e:
        client.generate("hi", model="plain", reasoning_budget=4)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.reasoning_budget" in str(e.value)
    result = client.generate("hi", model="plain", max_tokens=4)
    assert result.reasoning_text == "" and result.usage and result.usage.reasoning_tokens == 0
