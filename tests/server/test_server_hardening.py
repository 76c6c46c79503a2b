"""Hostile inputs found by a security review: each is refused INVALID_ARGUMENT naming its
field (never INTERNAL, never a server path), and none holds the event loop or the engine
for long: JSON nested past Python's stack, media-dir paths to loops, FIFOs and devices,
millions of stop token ids, and tool or pooling-input counts that made quadratic or
per-item work."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from mmserve.errors import InvalidArgument
from mmserve.frontend.tools import tool_request, tool_spec
from mmserve.params import MAX_STOP_TOKEN_IDS, SamplingParams
from mmserve.processors.images import ImageLimits, read_media_file
from mmserve.server import convert, convert_pooling
from mmserve_client.v1 import common_pb2, generate_pb2, pooling_pb2
from tests.server.conftest import ServerThread

INVALID = grpc.StatusCode.INVALID_ARGUMENT
DEEP = 100_000  # brackets: far past Python's recursion limit


def _refused(stub: Any, request: generate_pb2.GenerateRequest) -> str:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=60))
    assert e.value.code() == INVALID, e.value.details()
    return str(e.value.details())


def _chat(*messages: generate_pb2.Message, **kw: Any) -> generate_pb2.Chat:
    first = generate_pb2.Message(role="user", content=[generate_pb2.ContentPart(text="hi")])
    return generate_pb2.Chat(messages=[first, *messages], **kw)


def test_json_nested_past_the_stack_is_invalid_argument(stub: Any) -> None:
    """json.loads raises RecursionError (not JSONDecodeError) on deep nesting: it reached the
    client as INTERNAL, with an ERROR traceback in the log."""
    params = generate_pb2.SamplingParams(max_tokens=2)
    kwargs = _chat(template_kwargs={"enable_thinking": "[" * DEEP})
    message = _refused(stub, generate_pb2.GenerateRequest(model="tiny-a", chat=kwargs, params=params))
    assert message.startswith("chat.template_kwargs: enable_thinking must be true or false")
    call = generate_pb2.ToolCall(name="f", arguments_json='{"a": ' + "[" * DEEP)
    turn = generate_pb2.Message(role="assistant", tool_calls=[call])
    message = _refused(stub, generate_pb2.GenerateRequest(model="tiny-a", chat=_chat(turn), params=params))
    assert message == "chat.messages[1].tool_calls[0].arguments_json: invalid JSON: nested too deeply"


def test_strict_tool_schema_nested_too_deeply_is_invalid_argument() -> None:
    level = '{"type": "object", "properties": {"a": '
    schema = level * 300 + "{}" + "}}" * 300  # parses, but jsonschema recurses past the stack
    request = tool_request([tool_spec("chat.tools[0]", "f", schema, strict=True)], "auto")
    assert request is not None
    with pytest.raises(InvalidArgument) as e:
        request.accept()
    assert str(e.value) == "chat.tools[0].parameters_json: nested too deeply"


def test_many_tools_are_checked_in_linear_time_and_capped() -> None:
    specs = [tool_spec(f"chat.tools[{i}]", f"f{i}") for i in range(50_000)]
    start = time.monotonic()
    assert tool_request(specs, "auto") is not None  # names.count() per tool: ~20 s
    assert time.monotonic() - start < 2.0
    chat = _chat(tools=[generate_pb2.Tool(name=f"f{i}") for i in range(convert.MAX_TOOLS + 1)])
    with pytest.raises(InvalidArgument, match=rf"chat.tools: {convert.MAX_TOOLS + 1} tools; at most"):
        convert.chat_tools(chat)


def test_stop_token_ids_are_capped(stub: Any) -> None:
    """The scheduler looks each sampled token up in this list every step: 5M ids cost every
    request in the engine ~70 ms a step."""
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1)).validate()
    SamplingParams(stop_token_ids=[5] * MAX_STOP_TOKEN_IDS).validate()
    params = generate_pb2.SamplingParams(max_tokens=2, stop_token_ids=[5] * 1_000_000)
    request = generate_pb2.GenerateRequest(model="tiny-a", prompt="hi", params=params)
    assert _refused(stub, request).startswith("params.stop_token_ids: 1000000 ids; at most")


def test_pooling_inputs_past_the_limit_are_refused_before_conversion() -> None:
    items = [common_pb2.Input(text="")] * 3_000
    with pytest.raises(InvalidArgument, match="inputs: 3000 items exceed the limit"):
        convert_pooling.pooling_inputs("inputs", items)
    bad = [common_pb2.Input()] * 3_000  # the count is refused first, not item 0
    with pytest.raises(InvalidArgument, match="exceed the limit"):
        convert_pooling.pooling_inputs("inputs", bad)


def test_texts_far_past_the_context_are_refused_from_a_head(
    stub: Any, tiny_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 30 MB prompt was tokenised whole (~40 s of a front-end thread) before it was refused
    for exceeding the context: now only a head of it is, for a prompt and a chat alike."""
    tokenizer = tiny_server.handle("tiny-a").tokenizer
    encode_plus, seen = tokenizer._encode_plus, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        text = kwargs["text"] if "text" in kwargs else args[0]
        seen.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return encode_plus(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "_encode_plus", counting)
    text = " ".join(f"word{i % 977}" for i in range(100_000))  # ~900 KB
    message = _refused(stub, generate_pb2.GenerateRequest(model="tiny-a", prompt=text))
    assert re.fullmatch(
        r"prompt: at least \d+ tokens leave no room to generate: the limit is 1024 tokens", message
    )
    part = generate_pb2.ContentPart(text=text)
    chat = generate_pb2.Chat(messages=[generate_pb2.Message(role="user", content=[part])])
    message = _refused(stub, generate_pb2.GenerateRequest(model="tiny-a", chat=chat))
    assert re.fullmatch(r"chat: at least \d+ tokens leave no room .* 1024 tokens", message)
    assert seen and max(seen) < len(text) // 10
    embed = pooling_pb2.EmbedRequest(model="tiny-a", inputs=[common_pb2.Input(text=text)])
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(embed, timeout=60)
    assert e.value.code() == INVALID
    assert re.fullmatch(r"inputs\[0\]: at least \d+ tokens exceed the limit of 1024; .*", e.value.details())
    embed.truncate = common_pb2.TRUNCATE_RIGHT
    assert len(stub.Embed(embed, timeout=60).embeddings) == 1


@pytest.fixture
def media(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "media"
    (folder / "sub").mkdir(parents=True)
    os.mkfifo(folder / "fifo")
    (folder / "zero").symlink_to("/dev/zero")
    (folder / "loop1").symlink_to("loop2")
    (folder / "loop2").symlink_to("loop1")
    with open(folder / "huge.png", "wb") as f:  # sparse: no disk used
        f.truncate(ImageLimits().max_encoded_bytes + 1)
    yield folder


@pytest.mark.parametrize(
    "path, says",
    [
        ("loop1", "no such file in the media directory"),  # RuntimeError: INTERNAL before
        ("sub/../loop2", "no such file in the media directory"),
        ("fifo", "not a regular file"),  # opened O_NONBLOCK: never hangs
        ("zero", "path is outside the media directory"),
        ("sub", "not a regular file"),
        ("huge.png", "at most 20971520 bytes per image"),
    ],
)
def test_media_paths_that_are_no_image_file(media: Path, path: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        read_media_file(path, media, "image.path", ImageLimits())
    assert e.value.field == "image.path" and says in e.value.message
    assert str(media) not in str(e.value)


def test_detokenize_ids_are_capped(stub: Any) -> None:
    """Decoding holds Python's lock: past MAX_TOKENIZE_IDS the call is refused before it."""
    from mmserve.server.tokens import MAX_TOKENIZE_IDS
    from mmserve_client.v1 import tokenize_pb2

    request = tokenize_pb2.DetokenizeRequest(model="tiny-a", token_ids=[5] * (MAX_TOKENIZE_IDS + 1))
    with pytest.raises(grpc.RpcError) as e:
        stub.Detokenize(request, timeout=60)
    assert e.value.code() == INVALID
    assert str(e.value.details()).startswith(f"token_ids: {MAX_TOKENIZE_IDS + 1} ids; at most")
    text = stub.Detokenize(tokenize_pb2.DetokenizeRequest(model="tiny-a", token_ids=[5, 6]), timeout=60)
    assert text.text  # under the cap it decodes


def test_tokenize_texts_are_capped(
    stub: Any, tiny_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenising holds Python's lock (a 30 MB text held a thread ~40 s): a text far past
    MAX_TOKENIZE_IDS is refused from a head of it, the rest never tokenised; one just past it
    by its exact count; a chat's rendered text alike."""
    from mmserve.server import tokens
    from mmserve_client.v1 import tokenize_pb2

    monkeypatch.setattr(tokens, "MAX_TOKENIZE_IDS", 8)
    tokenizer = tiny_server.handle("tiny-a").tokenizer
    encoded: list[int] = []  # characters of each text tokenised

    def encode(text: str, *args: Any, **kwargs: Any) -> Any:
        encoded.append(len(text))
        return type(tokenizer).encode(tokenizer, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)

    def refused(**input: Any) -> str:
        with pytest.raises(grpc.RpcError) as e:
            stub.Tokenize(tokenize_pb2.TokenizeRequest(model="tiny-a", **input), timeout=60)
        assert e.value.code() == INVALID, e.value.details()
        return str(e.value.details())

    huge = "word " * 20_000
    assert re.fullmatch(r"text: at least \d+ tokens; at most 8 tokens", refused(text=huge))
    assert encoded and max(encoded) < len(huge) / 4
    assert re.fullmatch(r"text: \d+ tokens; at most 8 tokens", refused(text="word " * 20))
    message = generate_pb2.Message(role="user", content=[generate_pb2.ContentPart(text=huge)])
    chat = generate_pb2.Chat(messages=[message])
    assert re.fullmatch(r"chat: at least \d+ tokens; at most 8 tokens", refused(chat=chat))
    assert re.fullmatch(r"chat: \d+ tokens; at most 8 tokens", refused(chat=_chat()))
    ids = stub.Tokenize(tokenize_pb2.TokenizeRequest(model="tiny-a", text="hi"), timeout=60)
    assert 0 < len(ids.token_ids) <= 8  # under the cap it tokenises
