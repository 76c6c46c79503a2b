"""Unit tests without a server: proto <-> dataclass conversion, routing, error mapping, envs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from mmserve import envs
from mmserve.engine.messages import EngineInfo
from mmserve.errors import InvalidArgument, ResourceExhausted
from mmserve.frontend.frontend import FrontEnd
from mmserve.outputs import TokenLogprob
from mmserve.server import convert
from mmserve.server.config import ModelSpec, ServerConfig
from mmserve.server.errors import Unimplemented, code_of, rich_status
from mmserve.server.models import ModelFacts, ModelHandle, ModelRegistry, Task
from mmserve.structured_output import RelaxedKeyword
from mmserve_client.v1 import generate_pb2, models_pb2

CONFIG = ServerConfig()
Msg = generate_pb2.Message
Part = generate_pb2.ContentPart


def test_unset_sampling_fields_take_the_proto_defaults() -> None:
    p = convert.sampling_params(generate_pb2.SamplingParams(), CONFIG)
    assert (p.temperature, p.top_p, p.repetition_penalty) == (1.0, 1.0, 1.0)
    assert (p.n, p.max_tokens, p.seed, p.skip_special_tokens) == (1, None, None, True)
    convert.resolve_max_tokens(p, prompt_len=10, context=100, cap=4096)
    assert p.max_tokens == 90  # until the context is full...
    q = convert.sampling_params(generate_pb2.SamplingParams(), CONFIG)
    convert.resolve_max_tokens(q, prompt_len=10, context=100_000, cap=4096)
    assert q.max_tokens == 4096  # ...capped by the server's limit


def test_set_sampling_fields_are_kept() -> None:
    msg = generate_pb2.SamplingParams(
        temperature=0.0, top_p=0.5, n=2, max_tokens=7, seed=3, stop=["x"], logit_bias={5: -1.0}
    )
    msg.skip_special_tokens = False
    p = convert.sampling_params(msg, CONFIG)
    assert (p.temperature, p.top_p, p.n, p.max_tokens, p.seed) == (0.0, 0.5, 2, 7, 3)
    assert p.stop == ["x"] and p.logit_bias == {5: -1.0} and not p.skip_special_tokens


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"temperature": -0.5}, "params.temperature"),
        ({"n": 17}, "params.n"),
        ({"max_tokens": CONFIG.max_tokens + 1}, "params.max_tokens"),
        ({"presence_penalty": 3.0}, "params.presence_penalty"),
        ({"seed": 2**63}, "params.seed"),
        ({"logit_bias": {1: 101.0}}, "params.logit_bias[1]"),
    ],
)
def test_bad_sampling_fields_are_named(fields: dict[str, Any], named: str) -> None:
    """Server limits (n, max_tokens, seed) are refused by convert; the rest by the front end's
    one validation, which names them under params."""
    with pytest.raises(InvalidArgument) as e:
        p = convert.sampling_params(generate_pb2.SamplingParams(**fields), CONFIG)
        _frontend().validate([1, 2, 3], p, field="token_ids", params_field="params.")
    assert e.value.field == named


def _frontend(vocab: int = 10, context: int = 100) -> FrontEnd:
    """A front end over an engine that only answers its EngineInfo (validation needs no more)."""
    info = EngineInfo(
        model_folder="", gguf_file=None, architecture="LlamaForCausalLM", tasks=("generate",),
        max_model_len=context, vocab_size=vocab, logits_width=vocab, eos_token_ids=frozenset(),
        device="cpu", dtype="float32", quantization="", num_kv_blocks=8, block_size=16,
        uses_token_types=False,
    )
    client = SimpleNamespace(info=info)
    return FrontEnd(client, tokenizer=None)  # type: ignore[arg-type]


def test_model_checks_name_the_params_field() -> None:
    p = convert.sampling_params(generate_pb2.SamplingParams(max_tokens=50), CONFIG)
    frontend = _frontend(vocab=10, context=100)
    with pytest.raises(InvalidArgument, match="params.max_tokens"):
        frontend.validate([1] * 60, p, params_field="params.")
    with pytest.raises(InvalidArgument, match="no room"):
        frontend.validate([1] * 100, p, field="prompt", params_field="params.")
    with pytest.raises(InvalidArgument, match="token_ids: token id 10"):
        frontend.validate([1, 10], p, field="token_ids", params_field="params.")


def test_chat_messages_tools_and_kwargs() -> None:
    call = generate_pb2.ToolCall(id="c1", name="weather", arguments_json='{"city": "Paris"}')
    chat = generate_pb2.Chat(
        messages=[
            Msg(role="system", content=[Part(text="Be brief.")]),
            Msg(role="user", content=[Part(text="a"), Part(text="b")]),
            Msg(role="assistant", tool_calls=[call]),
            Msg(role="tool", content=[Part(text="sunny")], tool_call_id="c1", name="weather"),
        ],
        tools=[generate_pb2.Tool(name="weather", parameters_json='{"type": "object"}')],
        template_kwargs={"enable_thinking": "false", "reasoning_effort": "high"},
    )
    c = convert.chat_input(chat)
    assert c.messages[0] == {"role": "system", "content": "Be brief."}
    assert c.messages[1]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    assert c.messages[2] == {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert c.messages[3] == {
        "role": "tool",
        "content": "sunny",
        "tool_call_id": "c1",
        "name": "weather",
    }
    assert c.tools is not None and c.tools[0]["function"]["parameters"] == {"type": "object"}
    assert c.template_kwargs == {"enable_thinking": False, "reasoning_effort": "high"}
    assert c.add_generation_prompt is True and c.continue_final_message is False
    continued = convert.chat_input(
        generate_pb2.Chat(add_generation_prompt=False, continue_final_message=True)
    )
    assert (continued.add_generation_prompt, continued.continue_final_message) == (False, True)
    chat.tool_choice.mode = generate_pb2.ToolChoice.MODE_NONE
    assert convert.chat_input(chat).tools is None  # the model must not call: it sees none


def test_history_calls_without_an_id_have_none() -> None:
    # proto3 cannot tell an unset id from "": a template then numbers the calls itself (Command
    # A) or leaves the id out, as for a client's call without one, instead of printing ""
    call = generate_pb2.ToolCall(name="weather", arguments_json='{"city": "Paris"}')
    chat = generate_pb2.Chat(messages=[Msg(role="assistant", tool_calls=[call])])
    function = {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert convert.chat_input(chat).messages[0]["tool_calls"] == [
        {"type": "function", "function": function}
    ]


def test_history_thinking_reaches_the_template_as_reasoning_content() -> None:
    msg = Msg(role="assistant", reasoning_text="The user wants weather.", tool_calls=[
        generate_pb2.ToolCall(id="c1", name="weather", arguments_json="{}")])  # fmt: skip
    converted = convert.chat_input(generate_pb2.Chat(messages=[msg])).messages[0]
    assert converted["reasoning_content"] == "The user wants weather."
    plain = convert.chat_input(generate_pb2.Chat(messages=[Msg(role="user")])).messages[0]
    assert "reasoning_content" not in plain


@pytest.mark.parametrize(
    "chat, error, named",
    [
        (generate_pb2.Chat(tools=[generate_pb2.Tool(name="f", parameters_json="[1")]),
         InvalidArgument, "chat.tools[0].parameters_json"),
        (generate_pb2.Chat(tools=[generate_pb2.Tool(name="f"), generate_pb2.Tool(name="f")]),
         InvalidArgument, "chat.tools[0].name"),
        (generate_pb2.Chat(tools=[generate_pb2.Tool(name="f")],
                           tool_choice=generate_pb2.ToolChoice(function_name="g")),
         InvalidArgument, "chat.tool_choice.function_name"),
        (generate_pb2.Chat(tool_choice=generate_pb2.ToolChoice(mode=generate_pb2.ToolChoice.MODE_REQUIRED)),
         InvalidArgument, "chat.tool_choice.mode"),
        (generate_pb2.Chat(messages=[generate_pb2.Message(role="assistant", tool_calls=[
            generate_pb2.ToolCall(name="f"), generate_pb2.ToolCall(name="f", arguments_json="{x")])]),
         InvalidArgument, "chat.messages[0].tool_calls[1].arguments_json: invalid JSON"),
        (generate_pb2.Chat(messages=[generate_pb2.Message(role="assistant", tool_calls=[
            generate_pb2.ToolCall(name="f", arguments_json="[1]")])]),
         InvalidArgument, "chat.messages[0].tool_calls[0].arguments_json: must be a JSON object"),
        (generate_pb2.Chat(messages=[generate_pb2.Message(role="assistant", tool_calls=[
            generate_pb2.ToolCall(name="f"), generate_pb2.ToolCall(name=" ")])]),
         InvalidArgument, "chat.messages[0].tool_calls[1].name: must name the function"),
    ],
)  # fmt: skip
def test_bad_chats_are_named(chat: generate_pb2.Chat, error: type, named: str) -> None:
    with pytest.raises(error, match=named.replace("[", r"\[").replace("]", r"\]")):
        convert.chat_input(chat)


def _delta(**fields: Any) -> Any:
    base = {
        "index": 1,
        "text": "hi",
        "token_ids": [5],
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "relaxed_keywords": (),
    }
    return SimpleNamespace(**{**base, **fields})


def test_responses() -> None:
    text = {5: "five", 6: "six"}.__getitem__
    r = convert.response(_delta(), "rid", text)
    assert (r.request_id, r.index, r.text, list(r.token_ids)) == ("rid", 1, "hi", [5])
    assert r.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
    r = convert.response(_delta(finish_reason="stop", stop_reason="END"), "rid", text)
    assert r.finish_reason == generate_pb2.FINISH_REASON_STOP and r.stop_string == "END"
    r = convert.response(_delta(finish_reason="stop", stop_reason=2), "rid", text)
    assert r.WhichOneof("stop_reason") == "stop_token_id" and r.stop_token_id == 2
    r = convert.response(_delta(finish_reason="abort"), "rid", text)
    assert r.finish_reason == generate_pb2.FINISH_REASON_ABORTED
    relaxed = (RelaxedKeyword("/properties/a", "uniqueItems"),)
    r = convert.response(_delta(finish_reason="stop", relaxed_keywords=relaxed), "rid", text)
    assert [(k.pointer, k.keyword) for k in r.relaxed_keywords] == [("/properties/a", "uniqueItems")]
    lp = TokenLogprob(5, -0.5, 1, top=[(5, -0.5), (6, -1.5)])
    r = convert.response(_delta(logprobs=[lp]), "rid", text)
    assert r.logprobs[0].token == "five" and [t.token for t in r.logprobs[0].top] == ["five", "six"]
    assert len(convert.prompt_logprobs([None, lp, lp], text)) == 2
    t = convert.timing(received=1.0, queued=1.001, first=1.5, now=2.0)
    assert (t.queue_ms, t.first_token_ms, t.total_ms) == pytest.approx((1.0, 500.0, 1000.0))


def _handle(name: str, *tasks: Task) -> ModelHandle:
    facts = ModelFacts("LlamaForCausalLM", 128, "float32", "cpu", 100, quantization="gguf:Q4_1")
    return ModelHandle(name, frozenset(tasks), engine=None, tokenizer=None, facts=facts)


def test_routing() -> None:
    chat, other = _handle("chat", Task.GENERATE), _handle("emb", Task.EMBED)
    registry = ModelRegistry([chat, other])
    assert registry.get("", Task.GENERATE) is chat and registry.get("emb") is other
    with pytest.raises(
        InvalidArgument, match=r"model: unknown model 'x'; loaded: \['chat', 'emb'\]"
    ):
        registry.get("x", Task.GENERATE)
    with pytest.raises(InvalidArgument, match="'emb' cannot generate"):
        registry.get("emb", Task.GENERATE)
    with pytest.raises(InvalidArgument, match="no loaded model can rerank"):
        registry.get("", Task.RERANK)
    with pytest.raises(InvalidArgument, match="required"):
        registry.get("")  # any task: both qualify
    with pytest.raises(ValueError, match="unique"):
        ModelRegistry([chat, _handle("chat")])
    info = convert.model_info(chat)
    assert list(info.tasks) == [models_pb2.TASK_GENERATE] and info.quantization == "gguf:Q4_1"


def test_error_codes_and_retry_info() -> None:
    assert code_of(InvalidArgument("f", "m")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(ResourceExhausted("busy")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code_of(Unimplemented("x")) == grpc.StatusCode.UNIMPLEMENTED
    assert code_of(KeyError("bug")) == grpc.StatusCode.INTERNAL
    status = rich_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_after_s=1.5)
    call = SimpleNamespace(
        code=lambda: status.code, details=lambda: status.details,
        trailing_metadata=lambda: status.trailing_metadata,
    )  # fmt: skip
    decoded = rpc_status.from_call(call)
    info = error_details_pb2.RetryInfo()
    assert decoded is not None and decoded.details[0].Unpack(info)
    assert info.retry_delay.ToMilliseconds() == 1500


def test_envs_and_model_specs() -> None:
    assert envs.parse_bytes("512MiB") == 512 << 20 and envs.parse_bytes("2g") == 2 << 30
    assert envs.parse_bytes("1024") == 1024 and envs.parse_bool("Yes") is True
    with pytest.raises(ValueError):
        envs.parse_bytes("lots")
    env = envs.serve_env({"MMSERVE_MAX_N": "4", "MMSERVE_HOST": " ", "MMSERVE_MODEL": "a,b"})
    assert env == {"max_n": 4, "model": ["a", "b"]}  # a blank variable is not given
    assert envs.env_name("--max-num-seqs") == "MMSERVE_MAX_NUM_SEQS"
    assert envs.cache_dir({"MMSERVE_CACHE_DIR": "/tmp/c"}).as_posix() == "/tmp/c"
    assert ModelSpec.parse("/m/SmolLM2.Q4_1.gguf") == ModelSpec(
        "SmolLM2.Q4_1", "/m/SmolLM2.Q4_1.gguf"
    )
    assert ModelSpec.parse("chat=/m/folder/") == ModelSpec("chat", "/m/folder/")
    assert ModelSpec.parse("/m/folder/").name == "folder"


def test_error_messages_never_show_server_paths(tmp_path: Path) -> None:
    """Whatever an exception says, the client's message names no server path; JSON pointers,
    media types and the client's own relative paths stay."""
    from mmserve.server.errors import redact_paths

    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    said = f"engine failed: FileNotFoundError: {model}/config.json; also {Path.home()}/.cache"
    assert redact_paths(said) == "engine failed: FileNotFoundError: <path>; also <path>"
    kept = "structured.json_schema: at /properties/age/minimum: use application/json, pets/cat.png"
    assert redact_paths(kept) == kept


def test_structured_output_carries_relaxed() -> None:
    request = generate_pb2.GenerateRequest(
        structured=generate_pb2.StructuredOutput(json_schema='{"type": "object"}', relaxed=True)
    )
    params = convert.structured_output(request, "xgrammar")
    assert params is not None and params.relaxed and params.backend == "xgrammar"
    request.structured.relaxed = False
    params = convert.structured_output(request, "xgrammar")
    assert params is not None and not params.relaxed


def test_auto_backend_is_one_that_compiles_the_constraint() -> None:
    """BACKEND_AUTO (or unset) is the server's default backend, unless that one cannot compile
    the kind (outlines: grammars, structural tags): then xgrammar. A backend named stays."""
    s = generate_pb2.StructuredOutput
    for constraint, auto in [
        (s(grammar='root ::= "a"'), "xgrammar"),
        (s(structural_tag='{"format": {"type": "any_text"}}', backend=s.BACKEND_AUTO), "xgrammar"),
        (s(regex="a+"), "outlines"),
        (s(json_schema="{}", backend=s.BACKEND_AUTO), "outlines"),
    ]:
        request = generate_pb2.GenerateRequest(structured=constraint)
        params = convert.structured_output(request, "outlines")
        assert params is not None and params.backend == auto
        assert convert.structured_output(request, "xgrammar").backend == "xgrammar"  # type: ignore[union-attr]
    compact = generate_pb2.GenerateRequest(structured=s(json_schema="{}", disable_any_whitespace=True))
    params = convert.structured_output(compact, "outlines")
    assert params is not None and params.compact and params.backend == "xgrammar"
    named = generate_pb2.GenerateRequest(structured=s(grammar='root ::= "a"', backend=s.BACKEND_OUTLINES))
    assert convert.structured_output(named, "xgrammar").backend == "outlines"  # type: ignore[union-attr]
