"""Pure functions between the v1 protos and mmserve's dataclasses, applying the defaults the
proto comments promise (unset temperature = 1.0, ...). Every bad field raises InvalidArgument
(or Unimplemented, for what the server cannot do yet) naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.outputs import TokenLogprob
from mmserve.params import SamplingParams
from mmserve.server.config import ServerConfig
from mmserve.server.errors import Unimplemented
from mmserve.server.models import ModelHandle, Task
from mmserve_client._proto.mmserve.v1 import common_pb2, generate_pb2, models_pb2

MAX_SEED = 2**63 - 1  # n > 1 seeds choices seed, seed + 1, ...: keep those in torch's range
_FINISH = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORTED,
}
_TASKS = {
    Task.GENERATE: models_pb2.TASK_GENERATE,
    Task.EMBED: models_pb2.TASK_EMBED,
    Task.RERANK: models_pb2.TASK_RERANK,
    Task.CLASSIFY: models_pb2.TASK_CLASSIFY,
    Task.SCORE: models_pb2.TASK_SCORE,
}
_ToolChoice = generate_pb2.ToolChoice
TokenText = Callable[[int], str]  # token id -> its text, for logprobs


def _opt(msg: Any, name: str, default: Any) -> Any:
    return getattr(msg, name) if msg.HasField(name) else default


def sampling_params(p: generate_pb2.SamplingParams, config: ServerConfig) -> SamplingParams:
    """The request's params with the proto's defaults; server caps on n and max_tokens.
    max_tokens stays None when unset: resolve_max_tokens fills it once the prompt is known."""
    n = _opt(p, "n", 1)
    if not 1 <= n <= config.max_n:
        raise InvalidArgument("params.n", f"must be in [1, {config.max_n}], got {n}")
    max_tokens = _opt(p, "max_tokens", None)
    if max_tokens is not None and max_tokens > config.max_tokens:
        raise InvalidArgument(
            "params.max_tokens", f"{max_tokens} exceeds the server limit {config.max_tokens}"
        )
    seed = _opt(p, "seed", None)
    if seed is not None and seed > MAX_SEED:
        raise InvalidArgument("params.seed", f"must be <= {MAX_SEED}")
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=p.min_tokens,
        temperature=_opt(p, "temperature", 1.0),
        top_p=_opt(p, "top_p", 1.0),
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=_opt(p, "repetition_penalty", 1.0),
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=seed,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        n=n,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        logit_bias=dict(p.logit_bias),
        skip_special_tokens=_opt(p, "skip_special_tokens", True),
        include_stop_str_in_output=p.include_stop_str_in_output,
    )
    _as_params_field(params.validate)
    return params


def validate_for_model(
    params: SamplingParams, vocab_size: int, prompt_len: int, context: int
) -> None:
    """The checks that need the model (vocabulary, room left in the context)."""
    _as_params_field(lambda: params.validate_for_model(vocab_size, prompt_len, context))


def _as_params_field(check: Callable[[], None]) -> None:
    try:
        check()
    except InvalidArgument as e:  # name the field as the proto path spells it
        raise InvalidArgument(f"params.{e.field}", str(e).removeprefix(f"{e.field}: ")) from e


def resolve_max_tokens(params: SamplingParams, prompt_len: int, context: int, cap: int) -> None:
    """Unset max_tokens: until the context is full, capped by the server's limit."""
    if params.max_tokens is None:
        params.max_tokens = max(1, min(cap, context - prompt_len))


def check_structured(request: generate_pb2.GenerateRequest) -> None:
    """Structured output is not served yet: refuse rather than return unconstrained text."""
    s = request.structured
    kind = s.WhichOneof("constraint") if request.HasField("structured") else None
    if kind is None:
        return
    if kind == "json_schema":
        _json(f"structured.{kind}", s.json_schema)
    if kind == "json_object" and not s.json_object:
        raise InvalidArgument("structured.json_object", "false is not a constraint; leave it unset")
    raise Unimplemented(f"structured.{kind}: structured output is not supported yet")


@dataclass
class ChatInput:
    """A Chat proto as the chat-template processor takes it."""

    messages: list[dict[str, Any]]  # OpenAI-style message dicts
    tools: list[dict[str, Any]] | None  # OpenAI-style function tools; None = no tools
    add_generation_prompt: bool
    template_kwargs: dict[str, object]  # parsed values, checked against the allow-list later


def chat_input(chat: generate_pb2.Chat) -> ChatInput:
    add_generation_prompt = _opt(chat, "add_generation_prompt", True)
    if chat.continue_final_message:
        if add_generation_prompt:
            raise InvalidArgument(
                "chat.continue_final_message", "needs add_generation_prompt false"
            )
        raise Unimplemented("chat.continue_final_message: not supported yet")
    return ChatInput(
        messages=[_message(f"chat.messages[{i}]", m) for i, m in enumerate(chat.messages)],
        tools=_tools(chat),
        add_generation_prompt=add_generation_prompt,
        template_kwargs={k: _json_or_text(v) for k, v in chat.template_kwargs.items()},
    )


def _message(field: str, m: generate_pb2.Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role}
    texts = []
    for j, part in enumerate(m.content):
        if part.WhichOneof("part") == "image":
            raise InvalidArgument(f"{field}.content[{j}].image", "not supported by this model")
        texts.append({"type": "text", "text": part.text})
    if len(texts) == 1:
        out["content"] = texts[0]["text"]  # plain strings suit every template
    elif texts or not m.tool_calls:
        out["content"] = texts or ""
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments_json or "{}"},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _tools(chat: generate_pb2.Chat) -> list[dict[str, Any]] | None:
    tools = [_tool(f"chat.tools[{i}]", t) for i, t in enumerate(chat.tools)]
    choice = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    if choice == "function_name":
        names = [t.name for t in chat.tools]
        if chat.tool_choice.function_name not in names:
            raise InvalidArgument(
                "chat.tool_choice.function_name", f"not one of chat.tools {names}"
            )
        raise Unimplemented(
            "chat.tool_choice.function_name: forced tool calls are not supported yet"
        )
    mode = chat.tool_choice.mode if choice == "mode" else _ToolChoice.MODE_UNSPECIFIED
    if mode == _ToolChoice.MODE_REQUIRED:
        raise Unimplemented("chat.tool_choice.mode: MODE_REQUIRED is not supported yet")
    # MODE_NONE: the model must not call tools, so it is not shown any.
    return tools if tools and mode != _ToolChoice.MODE_NONE else None


def _tool(field: str, t: generate_pb2.Tool) -> dict[str, Any]:
    if not t.name:
        raise InvalidArgument(f"{field}.name", "must not be empty")
    if t.strict:
        raise Unimplemented(f"{field}.strict: constrained tool arguments are not supported yet")
    params = _json(f"{field}.parameters_json", t.parameters_json) if t.parameters_json else None
    if params is not None and not isinstance(params, dict):
        raise InvalidArgument(f"{field}.parameters_json", "must be a JSON Schema object")
    function: dict[str, Any] = {"name": t.name, "description": t.description}
    function["parameters"] = params or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _json(field: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(field, f"invalid JSON: {e}") from e


def _json_or_text(text: str) -> object:
    # template_kwargs values are JSON text; anything else passes as the plain string.
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def check_prompt(field: str, ids: Sequence[int], vocab_size: int, limit: int) -> None:
    """A prompt must be non-empty, in the vocabulary and shorter than `limit` tokens (room
    for at least one output token)."""
    if not ids:
        raise InvalidArgument(field, "must not be empty")
    check_token_ids(field, ids, vocab_size)
    if len(ids) >= limit:
        raise InvalidArgument(
            field, f"{len(ids)} tokens leave no room to generate: the limit is {limit} tokens"
        )


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def response(delta: Any, request_id: str, token_text: TokenText) -> generate_pb2.GenerateResponse:
    """One GenerationDelta as a chunk (usage, timing, prompt logprobs and model are the
    caller's to add: they depend on the stream's state)."""
    out = generate_pb2.GenerateResponse(
        request_id=request_id,
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=[token_logprob(lp, token_text) for lp in delta.logprobs or ()],
        finish_reason=_FINISH.get(delta.finish_reason, generate_pb2.FINISH_REASON_UNSPECIFIED),
    )
    if delta.finish_reason == "stop" and isinstance(delta.stop_reason, str):
        out.stop_string = delta.stop_reason
    elif delta.finish_reason == "stop" and isinstance(delta.stop_reason, int):
        out.stop_token_id = delta.stop_reason
    return out


def token_logprob(lp: TokenLogprob, token_text: TokenText) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        token=token_text(lp.token_id),
        top=[
            generate_pb2.TopLogprob(token_id=t, logprob=v, token=token_text(t)) for t, v in lp.top
        ],
    )


def prompt_logprobs(
    items: Sequence[TokenLogprob | None], token_text: TokenText
) -> list[generate_pb2.TokenLogprob]:
    """From the second prompt token on: the first has no context, hence no entry."""
    return [token_logprob(lp, token_text) for lp in items if lp is not None]


def usage(prompt: int, completion: int, cached: int) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached
    )


def timing(received: float, queued: float, first: float | None, now: float) -> common_pb2.Timing:
    """Monotonic seconds -> ms since the server received the request."""
    first = now if first is None else first
    return common_pb2.Timing(
        queue_ms=(queued - received) * 1e3,
        first_token_ms=(first - received) * 1e3,
        total_ms=(now - received) * 1e3,
    )


def model_info(handle: ModelHandle) -> models_pb2.ModelInfo:
    f = handle.facts
    return models_pb2.ModelInfo(
        name=handle.name,
        tasks=[_TASKS[t] for t in Task if t in handle.tasks],
        max_context=f.max_context,
        dtype=f.dtype,
        device=f.device,
        architecture=f.architecture,
        supports_images=f.supports_images,
        quantization=f.quantization,
        vocab_size=f.vocab_size,
    )
