"""Chat templates served: a template that never finishes fails its own chat at the budget
(--template-timeout-ms) while other models, each on front-end threads of its own, answer at
once; continue_final_message prompts are transformers' over Tokenize and Generate."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from mmserve.config import DEFAULT_FRONTEND_THREADS
from mmserve.server.config import ModelSpec
from mmserve_client import Client
from mmserve_client.v1 import generate_pb2, tokenize_pb2
from tests.server.conftest import ServerThread, serve
from tests.utils.chat_templates import QWEN25_TEMPLATE
from tests.utils.tiny_models import CHATML_TEMPLATE, make_tiny_model

BUDGET_MS = 1000
# renders forever when the last message says "loop" (range() is capped at 100,000: nest it)
LOOPING = (
    "{% if messages[-1].content == 'loop' %}{% set r = range(100000) %}"
    "{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}{% endif %}" + CHATML_TEMPLATE
)
STUCK_MESSAGE = "chat: the model's chat template did not finish within 1000 ms"
LOOP = [{"role": "user", "content": "loop"}]
HELLO = [{"role": "user", "content": "Hello"}]
PARTIAL = [*HELLO, {"role": "assistant", "content": "Hello world, this is"}]
# more stuck calls than asyncio's default pool has threads, and twice the model's own
STUCK_CALLS = max(8, min(32, (os.cpu_count() or 1) + 4) + 2, 2 * DEFAULT_FRONTEND_THREADS)


def _with_template(folder: Path, template: str) -> Path:
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {
        "looping": _with_template(make_tiny_model(root, "llama", seed=0, name="looping"), LOOPING),
        "qwen": _with_template(make_tiny_model(root, "qwen2", seed=1, name="qwen"), QWEN25_TEMPLATE),
    }


@pytest.fixture(scope="module")
def tiny_server(folders: dict[str, Path]) -> Iterator[ServerThread]:
    """This module's server (conftest's `stub` talks to it): the two models above."""
    s = serve([ModelSpec(n, str(p)) for n, p in folders.items()], template_timeout_ms=BUDGET_MS)
    yield s
    s.stop()


def _chat(messages: list[dict[str, str]], **options: Any) -> generate_pb2.Chat:
    parts = [
        generate_pb2.Message(role=m["role"], content=[generate_pb2.ContentPart(text=m["content"])])
        for m in messages
    ]
    return generate_pb2.Chat(messages=parts, **options)


def _tokenize_chat(stub: Any, model: str, chat: generate_pb2.Chat) -> Any:
    return stub.Tokenize(tokenize_pb2.TokenizeRequest(model=model, chat=chat), timeout=30)


def test_endless_template_fails_its_chat_at_the_budget(stub: Any) -> None:
    request = generate_pb2.GenerateRequest(model="looping", chat=_chat(LOOP))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=30))
    elapsed = time.monotonic() - start
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == STUCK_MESSAGE
    assert BUDGET_MS / 1000 <= elapsed < BUDGET_MS / 1000 + 2.0


def _generate_chat(stub: Any, model: str, chat: generate_pb2.Chat, **params: Any) -> list[Any]:
    request = generate_pb2.GenerateRequest(
        model=model, chat=chat, params=generate_pb2.SamplingParams(**params)
    )
    return list(stub.Generate(request, timeout=30))


def test_stuck_renders_do_not_hold_up_another_model(stub: Any) -> None:
    with ThreadPoolExecutor(STUCK_CALLS) as pool:
        stuck = [
            pool.submit(_tokenize_chat if i % 2 else _generate_chat, stub, "looping", _chat(LOOP))
            for i in range(STUCK_CALLS)
        ]
        time.sleep(0.1)  # the looping model's threads are all busy, its queue full
        answer = _generate_chat(stub, "qwen", _chat(HELLO), max_tokens=3, temperature=0)
        text = tokenize_pb2.TokenizeRequest(model="qwen", text="The quick brown fox. " * 240)
        tokens = stub.Tokenize(text, timeout=30)  # 5,040 characters: tokenised off the loop
        assert not any(f.done() for f in stuck), "answered only after a stuck render ended"
        assert answer[-1].usage.completion_tokens == 3
        assert len(tokens.token_ids) > 240
        for call in stuck:
            error = call.exception(timeout=30)
            assert isinstance(error, grpc.RpcError)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == STUCK_MESSAGE
    # the stopped renders gave their threads back: the same model renders the next chat
    assert len(_tokenize_chat(stub, "looping", _chat(HELLO)).token_ids) > 3


def _transformers_ids(folder: Path, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return list(tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False,
        sanitize_control_tokens=True,
    ))


def test_continue_final_message_is_transformers_prompt(
    stub: Any, tiny_server: ServerThread, folders: dict[str, Path]
) -> None:
    expected = _transformers_ids(folders["qwen"], PARTIAL)
    chat = _chat(PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert list(_tokenize_chat(stub, "qwen", chat).token_ids) == expected
    with Client(tiny_server.target, timeout=30) as client:  # the SDK opens no new turn itself
        continued = client.chat(PARTIAL, model="qwen", continue_final_message=True,
                                max_tokens=4, temperature=0, ignore_eos=True)
        direct = client.generate(expected, model="qwen", max_tokens=4, temperature=0,
                                 ignore_eos=True)
    assert continued.usage is not None and continued.usage.prompt_tokens == len(expected)
    assert continued.token_ids == direct.token_ids


@pytest.mark.parametrize(
    ("messages", "options", "says"),
    [
        (PARTIAL, {"continue_final_message": True}, "needs add_generation_prompt false"),
        (HELLO, {"continue_final_message": True, "add_generation_prompt": False}, "assistant's"),
    ],
)
def test_continue_final_message_errors_are_named(
    stub: Any, messages: list[dict[str, str]], options: dict[str, Any], says: str
) -> None:
    request = generate_pb2.GenerateRequest(model="qwen", chat=_chat(messages, **options))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("chat.continue_final_message: ")
    assert says in e.value.details()


def test_front_end_threads_stop_with_the_model(folders: dict[str, Path]) -> None:
    server = serve([ModelSpec("qwen", str(folders["qwen"]))], frontend_threads=1)
    handle = server.handle("qwen")
    assert server.run(handle.engine.run(len, "abc")) == 3
    server.stop()
    with pytest.raises(RuntimeError, match="shutdown"):
        handle.engine.executor.submit(len, "x")
