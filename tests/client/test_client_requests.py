"""Pure conversions from Python values to request protos (no server)."""

from __future__ import annotations

import base64
import json

import pytest

from mmserve_client import Image, ToolCall
from mmserve_client._channel import SERVICE, service_config
from mmserve_client._chat import chat_from_kwargs, chat_request
from mmserve_client._requests import embed_request, generate_request, inputs
from mmserve_client.v1 import generate_pb2


def test_sampling_kwargs_fill_params_and_none_means_unset() -> None:
    req = generate_request(
        "x",
        None,
        {
            "max_tokens": 3,
            "top_p": None,
            "stop": "END",
            "seed": 7,
            "logit_bias": {5: -1},
            "skip_special_tokens": False,
            "cache_salt": "tenant",
        },
    )
    p = req.params
    assert (p.max_tokens, list(p.stop), p.seed, dict(p.logit_bias)) == (3, ["END"], 7, {5: -1.0})
    assert p.HasField("skip_special_tokens") and not p.skip_special_tokens
    assert not p.HasField("top_p") and not p.HasField("n") and not p.HasField("temperature")
    assert req.cache_salt == "tenant" and not req.HasField("structured")


def test_every_sampling_field_of_the_proto_is_a_keyword() -> None:
    """Each SamplingParams field reaches the request by its own name (a field added to the
    proto too), and GenerateKwargs types every one of them."""
    from mmserve_client._requests import GenerateKwargs

    for field in generate_pb2.SamplingParams.DESCRIPTOR.fields:
        assert field.name in GenerateKwargs.__annotations__ or field.name == "n", field.name
        if field.is_repeated or field.name == "n":
            continue
        value = 1.5 if field.cpp_type == field.CPPTYPE_FLOAT else 2
        value = True if field.cpp_type == field.CPPTYPE_BOOL else value
        req = generate_request("x", None, {field.name: value})  # type: ignore[misc]
        assert getattr(req.params, field.name) == value, field.name


def test_structured_constraints() -> None:
    req = generate_request(
        "x", None, {"json_schema": {"type": "object"}, "structured_backend": "xgrammar"}
    )
    assert json.loads(req.structured.json_schema) == {"type": "object"}
    assert req.structured.backend == generate_pb2.StructuredOutput.BACKEND_XGRAMMAR
    req = generate_request("x", None, {"choice": ["yes", "no"]})
    assert list(req.structured.choice.choices) == ["yes", "no"]
    with pytest.raises(ValueError, match="at most one"):
        generate_request("x", None, {"regex": "a+", "grammar": "root ::= 'a'"})
    with pytest.raises(ValueError, match="structured_backend"):
        generate_request("x", None, {"structured_backend": "bogus"})  # type: ignore[typeddict-item]
    req = generate_request("x", None, {"json_schema": {"type": "object"}, "relaxed": True})
    assert req.structured.relaxed
    assert not generate_request("x", None, {"json_schema": "{}"}).structured.relaxed
    tag = {"type": "structural_tag", "format": {"type": "any_text"}}
    req = generate_request("x", None, {"structural_tag": tag})
    assert req.structured.WhichOneof("constraint") == "structural_tag"
    assert json.loads(req.structured.structural_tag) == tag
    assert generate_request("x", None, {"structural_tag": "{}"}).structured.structural_tag == "{}"
    req = generate_request("x", None, {"json_object": True, "disable_any_whitespace": True})
    assert req.structured.json_object and req.structured.disable_any_whitespace


def test_chat_messages_parts_tools_and_history() -> None:
    png = b"\x89PNG\r\n"
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    chat = chat_request(
        [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is"},
                    {"type": "image_url", "image_url": {"url": data_url}},
                    Image(path="/media/a.png"),
                    {"type": "image", "uuid": "u1"},
                ],
            },
            {
                "role": "assistant",
                "reasoning_content": "f answers it",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": {"a": 1}},
                    },
                    ToolCall("c2", "g", "{}"),
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        tools=[
            {"name": "f", "description": "d", "parameters": '{"type": "object"}', "strict": True}
        ],
        tool_choice={"type": "function", "function": {"name": "f"}},
        template_kwargs={"enable_thinking": False, "effort": "high"},
    )
    user = chat.messages[1]
    assert [p.WhichOneof("part") for p in user.content] == ["text", "image", "image", "image"]
    assert user.content[1].image.data == png and user.content[2].image.path == "/media/a.png"
    calls = chat.messages[2].tool_calls
    assert chat.messages[2].reasoning_text == "f answers it"
    assert (calls[0].name, json.loads(calls[0].arguments_json), calls[1].id) == (
        "f",
        {"a": 1},
        "c2",
    )
    assert chat.messages[3].tool_call_id == "c1"
    assert chat.tools[0].strict and chat.tool_choice.function_name == "f"
    assert dict(chat.template_kwargs) == {"enable_thinking": "false", "effort": "high"}
    assert not chat.HasField("add_generation_prompt")


def test_continuing_a_message_opens_no_turn() -> None:
    partial = [{"role": "assistant", "content": "The capital is"}]
    chat = chat_request(partial, continue_final_message=True)
    assert chat.continue_final_message and chat.HasField("add_generation_prompt")
    assert chat.add_generation_prompt is False
    chat = chat_request(partial, continue_final_message=True, add_generation_prompt=True)
    assert chat.add_generation_prompt is True  # as asked: the server refuses it, naming it


def test_chat_kwargs_split_and_errors() -> None:
    chat, rest = chat_from_kwargs(
        [{"role": "user", "content": "hi"}], {"tool_choice": "none", "max_tokens": 2}
    )
    assert chat.tool_choice.mode == generate_pb2.ToolChoice.MODE_NONE and rest == {"max_tokens": 2}
    with pytest.raises(ValueError, match="role"):
        chat_request([{"content": "no role"}])
    with pytest.raises(ValueError, match="data: URL"):
        chat_request(
            [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x"}]}]
        )


def test_inputs_accept_one_or_many() -> None:
    assert [i.WhichOneof("kind") for i in inputs("a")] == ["text"]
    assert [i.WhichOneof("kind") for i in inputs([1, 2])] == ["token_ids"]
    assert [i.WhichOneof("kind") for i in inputs(["a", [1], b"img"])] == [
        "text",
        "token_ids",
        "image",
    ]
    assert inputs([]) == []
    with pytest.raises(TypeError):
        inputs([1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="encoding"):
        embed_request(["a"], None, None, None, "bf16", "", "")  # type: ignore[arg-type]


def test_retry_policy_names_real_idempotent_rpcs() -> None:
    config = json.loads(service_config(retry_attempts=4))
    (method_config,) = config["methodConfig"]
    names = {n["method"] for n in method_config["name"]}
    rpcs = {m.name for m in SERVICE.methods}
    assert names == rpcs  # Generate too: gRPC retries it only before its first response
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert "methodConfig" not in json.loads(service_config(retry_attempts=1))


def test_relaxed_keywords_reach_the_result() -> None:
    from mmserve_client import RelaxedKeyword
    from mmserve_client._responses import Collector, chunk

    resp = generate_pb2.GenerateResponse(text="{}", finish_reason=generate_pb2.FINISH_REASON_STOP)
    resp.relaxed_keywords.add(pointer="/properties/a", keyword="uniqueItems")
    collector = Collector()
    collector.add(chunk(generate_pb2.GenerateResponse(text="")))
    collector.add(chunk(resp))
    (result,) = collector.results()
    assert result.relaxed_keywords == (RelaxedKeyword("/properties/a", "uniqueItems"),)
