"""The SDK against the protos, field by field: every request field can be set from the SDK
under the proto's name, and every response field reaches the caller under its name. A field
added to a .proto without its SDK side fails here, naming it."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor

from mmserve_client import (
    ChatKwargs,
    Classification,
    Client,
    GenerateChunk,
    GenerateKwargs,
    LabelScore,
    LoadReport,
    ModelInfo,
    ModelLoad,
    RelaxedKeyword,
    RerankResult,
    ResultList,
    Timing,
    TokenizeResult,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from mmserve_client._chat import chat_request
from mmserve_client.v1 import (
    common_pb2,
    generate_pb2,
    inference_pb2,
    load_pb2,
    models_pb2,
    pooling_pb2,
    tokenize_pb2,
)

# request message -> (SDK method, {proto field: the SDK's name for it})
REQUESTS: list[tuple[Descriptor, Callable[..., Any], dict[str, str]]] = [
    (pooling_pb2.EmbedRequest.DESCRIPTOR, Client.embed, {}),
    (pooling_pb2.RerankRequest.DESCRIPTOR, Client.rerank, {}),
    (pooling_pb2.ClassifyRequest.DESCRIPTOR, Client.classify, {}),
    (pooling_pb2.ScoreRequest.DESCRIPTOR, Client.score, {}),
    # text: a str; chat: a list of messages, in the same argument
    (tokenize_pb2.TokenizeRequest.DESCRIPTOR, Client.tokenize, {"chat": "text"}),
    (tokenize_pb2.DetokenizeRequest.DESCRIPTOR, Client.detokenize, {}),
    (models_pb2.ListModelsRequest.DESCRIPTOR, Client.list_models, {}),
    (load_pb2.WatchLoadRequest.DESCRIPTOR, Client.watch_load, {}),
]


@pytest.mark.parametrize("message, method, renamed", REQUESTS, ids=[r[0].name for r in REQUESTS])
def test_every_request_field_is_an_argument(
    message: Descriptor, method: Callable[..., Any], renamed: dict[str, str]
) -> None:
    arguments = set(inspect.signature(method).parameters)
    missing = [f.name for f in message.fields if renamed.get(f.name, f.name) not in arguments]
    assert not missing, f"{message.name}: no argument of {method.__name__} sets {missing}"


def test_every_generate_field_is_a_keyword() -> None:
    """GenerateRequest, its SamplingParams and StructuredOutput, and Chat: generate/chat's
    keywords (the input is the positional argument; n is a keyword of its own)."""
    keywords = set(typing.get_type_hints(ChatKwargs)) | {"n"}
    assert set(GenerateKwargs.__annotations__) <= keywords
    structured = generate_pb2.StructuredOutput.DESCRIPTOR
    expected = {
        "GenerateRequest": {f.name for f in generate_pb2.GenerateRequest.DESCRIPTOR.fields}
        - {"prompt", "token_ids", "chat", "params", "structured"},
        "SamplingParams": {f.name for f in generate_pb2.SamplingParams.DESCRIPTOR.fields},
        "StructuredOutput": {f.name for f in structured.fields} - {"backend", "choice"}
        | {"structured_backend", "choice"},
        "Chat": {f.name for f in generate_pb2.Chat.DESCRIPTOR.fields} - {"messages"},
    }
    for message, names in expected.items():
        assert names <= keywords, f"{message}: no keyword for {sorted(names - keywords)}"


def test_every_message_and_tool_field_is_read_from_the_dicts() -> None:
    """An OpenAI-style message and tool dict with every key set fills every proto field."""
    chat = chat_request(
        [{
            "role": "assistant", "content": "hi", "name": "bot", "tool_call_id": "c0",
            "reasoning_content": "hmm",
            "tool_calls": [{"id": "c0", "function": {"name": "f", "arguments": {"a": 1}}}],
        }],
        tools=[{"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}],
    )  # fmt: skip
    for message in (chat.messages[0], chat.messages[0].tool_calls[0], chat.tools[0]):
        unset = [f.name for f in message.DESCRIPTOR.fields if not _is_set(message, f.name)]
        assert not unset, f"{message.DESCRIPTOR.name}: the dict cannot set {unset}"


def _is_set(message: Any, name: str) -> bool:
    value = getattr(message, name)
    return bool(len(value) if hasattr(value, "__len__") else value)


# response message -> (the SDK type that carries it, {proto field: the SDK's name for it});
# a field renamed to "" is the list's items (ResultList) or is deliberately not kept
RESPONSES: list[tuple[Descriptor, type, dict[str, str]]] = [
    (
        generate_pb2.GenerateResponse.DESCRIPTOR,
        GenerateChunk,
        {"stop_string": "stop", "stop_token_id": "stop"},  # the stop_reason oneof
    ),
    (generate_pb2.TokenLogprob.DESCRIPTOR, TokenLogprob, {}),
    (generate_pb2.TopLogprob.DESCRIPTOR, TopLogprob, {}),
    (generate_pb2.ToolCallDelta.DESCRIPTOR, ToolCallDelta, {}),
    (generate_pb2.RelaxedKeyword.DESCRIPTOR, RelaxedKeyword, {}),
    (common_pb2.Usage.DESCRIPTOR, Usage, {}),
    (common_pb2.Timing.DESCRIPTOR, Timing, {}),
    (pooling_pb2.EmbedResponse.DESCRIPTOR, ResultList, {"embeddings": ""}),
    (pooling_pb2.RerankResponse.DESCRIPTOR, ResultList, {"results": ""}),
    (pooling_pb2.RerankResult.DESCRIPTOR, RerankResult, {}),
    (pooling_pb2.ClassifyResponse.DESCRIPTOR, ResultList, {"results": ""}),
    (pooling_pb2.Classification.DESCRIPTOR, Classification, {}),
    (pooling_pb2.LabelScore.DESCRIPTOR, LabelScore, {}),
    (pooling_pb2.ScoreResponse.DESCRIPTOR, ResultList, {"scores": ""}),
    (tokenize_pb2.TokenizeResponse.DESCRIPTOR, TokenizeResult, {}),
    (models_pb2.ListModelsResponse.DESCRIPTOR, ResultList, {"models": ""}),
    (models_pb2.ModelInfo.DESCRIPTOR, ModelInfo, {}),
    (load_pb2.WatchLoadResponse.DESCRIPTOR, LoadReport, {}),
    (load_pb2.ModelLoad.DESCRIPTOR, ModelLoad, {}),
]


# responses the SDK reduces to one value on purpose
REDUCED = {tokenize_pb2.DetokenizeResponse.DESCRIPTOR: "detokenize returns the text alone"}


def test_every_rpc_response_is_checked() -> None:
    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    checked = {r[0] for r in RESPONSES} | set(REDUCED)
    unchecked = [m.name for m in service.methods if m.output_type not in checked]
    assert not unchecked, f"add the responses of {unchecked} to RESPONSES"


@pytest.mark.parametrize("message, kind, renamed", RESPONSES, ids=[r[0].name for r in RESPONSES])
def test_every_response_field_reaches_the_caller(
    message: Descriptor, kind: type, renamed: dict[str, str]
) -> None:
    if dataclasses.is_dataclass(kind):
        names = {f.name for f in dataclasses.fields(kind)}
    else:
        names = set(vars(kind()))  # ResultList: its attributes
    kept = [renamed.get(f.name, f.name) for f in message.fields]
    missing = [name for name in kept if name and name not in names]
    assert not missing, f"{message.name}: {kind.__name__} drops {missing}"
