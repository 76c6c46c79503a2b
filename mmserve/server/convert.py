"""Pure functions between the v1 protos and mmserve's dataclasses, applying the defaults the
proto comments promise (unset temperature = 1.0, ...). Every bad field raises InvalidArgument
naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.frontend.chat import ChatInput
from mmserve.frontend.tools import ToolRequest, tool_request, tool_spec
from mmserve.outputs import TokenLogprob
from mmserve.params import SamplingParams
from mmserve.processors.images import ImageSource
from mmserve.processors.tool_parsers import ToolCallDelta
from mmserve.server.config import ServerConfig
from mmserve.server.images import image_source
from mmserve.server.models import ModelHandle, Task
from mmserve.structured_output.params import StructuredOutputParams
from mmserve.structured_output.registry import auto_backend
from mmserve_client.v1 import common_pb2, generate_pb2, models_pb2

MAX_SEED = 2**63 - 1  # n > 1 seeds choices seed, seed + 1, ...: keep those in torch's range
# tools of one chat (OpenAI allows 128): a strict tool's schema is checked per request, and
# 5,000 small ones took 2.4 s of a front-end thread
MAX_TOOLS = 256
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
_SCORE_METHODS = {
    "cross-encoder": models_pb2.SCORE_METHOD_CROSS_ENCODER,
    "cosine": models_pb2.SCORE_METHOD_COSINE,
    "yes-token": models_pb2.SCORE_METHOD_YES_TOKEN,
}
_Backend = generate_pb2.StructuredOutput
_BACKENDS = {  # None: the server's default (--structured-output-backend)
    _Backend.BACKEND_UNSPECIFIED: None,
    _Backend.BACKEND_AUTO: None,
    _Backend.BACKEND_XGRAMMAR: "xgrammar",
    _Backend.BACKEND_OUTLINES: "outlines",
}
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
        reasoning_budget=_opt(p, "reasoning_budget", None),
        disable_speculation=p.disable_speculation,
        allowed_token_ids=list(p.allowed_token_ids),
        bad_words=list(p.bad_words),
        truncate_prompt_tokens=_opt(p, "truncate_prompt_tokens", None),
    )
    return params  # the model's front end validates it (once), naming params.* fields


def resolve_max_tokens(params: SamplingParams, prompt_len: int, context: int, cap: int) -> None:
    """Unset max_tokens: until the context is full, capped by the server's limit."""
    if params.max_tokens is None:
        params.max_tokens = max(1, min(cap, context - prompt_len))


def structured_output(
    request: generate_pb2.GenerateRequest, default_backend: str
) -> StructuredOutputParams | None:
    """The request's output constraint (the front end validates and compiles it, off the
    loop); None when it sets none."""
    s = request.structured
    kind = s.WhichOneof("constraint") if request.HasField("structured") else None
    if kind is None:
        return None
    if kind == "json_object" and not s.json_object:
        raise InvalidArgument("structured.json_object", "false is not a constraint; leave it unset")
    value = "" if kind == "json_object" else getattr(s, kind)
    if kind == "choice":
        value = tuple(s.choice.choices)
    params = StructuredOutputParams(
        kind, value, relaxed=s.relaxed, disable_any_whitespace=s.disable_any_whitespace
    )
    return replace(params, backend=structured_backend(request, default_backend, params.needs))


def structured_backend(
    request: generate_pb2.GenerateRequest,
    default_backend: str,
    needs: frozenset[str] = frozenset({"json_schema"}),
) -> str:
    """The grammar backend a request asks for (also for its tool_choice constraint, a JSON
    schema): AUTO is the server's default, unless it cannot compile what `needs` names
    (StructuredOutputParams.needs)."""
    backend = request.structured.backend
    if backend not in _BACKENDS:
        raise InvalidArgument("structured.backend", f"unknown backend {backend}")
    return _BACKENDS[backend] or auto_backend(needs, default_backend)


@dataclass
class ProtoChat(ChatInput):
    """A Chat proto as the front end takes it, with its images' sources (the server loads
    them: its media directory and uuid registry)."""

    sources: list[ImageSource] = field(default_factory=list)  # one per chat.image_fields


def chat_input(chat: generate_pb2.Chat) -> ProtoChat:
    """The chat as the front end takes it; what only its template can check (roles, content,
    continue_final_message's conditions) is checked when it renders."""
    request = chat_tools(chat)
    images: list[tuple[str, ImageSource]] = []
    return ProtoChat(
        messages=[_message(f"chat.messages[{i}]", m, images) for i, m in enumerate(chat.messages)],
        tools=[s.template() for s in request.tools] if request is not None else None,
        add_generation_prompt=_opt(chat, "add_generation_prompt", True),
        continue_final_message=chat.continue_final_message,
        template_kwargs={k: _json_or_text(v) for k, v in chat.template_kwargs.items()},
        tool_request=request,
        image_fields=[f for f, _ in images],
        sources=[source for _, source in images],
    )


def chat_tools(chat: generate_pb2.Chat) -> ToolRequest | None:
    """The chat's tools and tool_choice; None when no tool can be called (no tools, or
    tool_choice none: then the model does not see them either)."""
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidArgument("chat.tools", f"{len(chat.tools)} tools; at most {MAX_TOOLS}")
    specs = [
        tool_spec(f"chat.tools[{i}]", t.name, t.parameters_json, t.strict, t.description)
        for i, t in enumerate(chat.tools)
    ]
    mode, function = _tool_choice(chat)
    return tool_request(specs, mode, function)


_ToolMode = generate_pb2.ToolChoice
_TOOL_MODES = {
    _ToolMode.MODE_UNSPECIFIED: "auto",
    _ToolMode.MODE_AUTO: "auto",
    _ToolMode.MODE_NONE: "none",
    _ToolMode.MODE_REQUIRED: "required",
}


def _tool_choice(chat: generate_pb2.Chat) -> tuple[str, str]:
    """(mode, function name); unset is auto (with tools; without, nothing can be called)."""
    which = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    if which == "function_name":
        return "function", chat.tool_choice.function_name
    mode = chat.tool_choice.mode if which == "mode" else _ToolMode.MODE_UNSPECIFIED
    if mode not in _TOOL_MODES:
        raise InvalidArgument("chat.tool_choice.mode", f"unknown mode {mode}")
    return _TOOL_MODES[mode], ""


def call_deltas(calls: Sequence[ToolCallDelta]) -> list[generate_pb2.ToolCallDelta]:
    return [
        generate_pb2.ToolCallDelta(
            index=c.index, id=c.id, name=c.name, arguments_delta=c.arguments_delta
        )
        for c in calls
    ]


def _message(
    field: str, m: generate_pb2.Message, images: list[tuple[str, ImageSource]]
) -> dict[str, Any]:
    """The message as a template dict; its images are appended to `images`."""
    out: dict[str, Any] = {"role": m.role}
    parts: list[dict[str, str]] = []
    for j, part in enumerate(m.content):
        if part.WhichOneof("part") == "image":
            images.append((f"{field}.content[{j}].image", image_source(part.image)))
            parts.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": part.text})
    if len(parts) == 1 and parts[0]["type"] == "text":
        out["content"] = parts[0]["text"]  # plain strings suit every template
    elif parts or not m.tool_calls:
        out["content"] = parts or ""
    if m.tool_calls:
        calls = enumerate(m.tool_calls)
        out["tool_calls"] = [_tool_call(f"{field}.tool_calls[{k}]", c) for k, c in calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_text:
        out["reasoning_content"] = m.reasoning_text
    if m.name:
        out["name"] = m.name
    return out


def _tool_call(field: str, call: generate_pb2.ToolCall) -> dict[str, Any]:
    """A history call in OpenAI's shape. An empty id is left out, as a client that sent none
    left it out: templates fall back on their own (Command A numbers the calls) where they
    would otherwise print the empty id."""
    out: dict[str, Any] = {"id": call.id} if call.id else {}
    out["type"] = "function"
    out["function"] = {
        "name": _call_name(f"{field}.name", call),
        "arguments": _arguments(f"{field}.arguments_json", call),
    }
    return out


def _call_name(field: str, call: generate_pb2.ToolCall) -> str:
    """A history call's function name: a template renders it into the prompt, so it is
    never empty."""
    if not call.name.strip():
        raise InvalidArgument(field, "must name the function called")
    return call.name


def _arguments(field: str, call: generate_pb2.ToolCall) -> str:
    """A history call's arguments_json, checked here so that an error names the proto's
    field (the template's own check would name the OpenAI dict's `function.arguments`)."""
    text = call.arguments_json or "{}"
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(field, f"invalid JSON: {e}") from e
    except RecursionError:  # nested deeper than Python's stack
        raise InvalidArgument(field, "invalid JSON: nested too deeply") from None
    if not isinstance(arguments, dict):
        raise InvalidArgument(field, "must be a JSON object")
    return text


def _json_or_text(text: str) -> object:
    # template_kwargs values are JSON text; anything else (nesting too deep for Python's stack
    # included) passes as the plain string, which the value's parser refuses.
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


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
    out.relaxed_keywords.extend(
        generate_pb2.RelaxedKeyword(pointer=r.pointer, keyword=r.keyword)
        for r in delta.relaxed_keywords
    )
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


def usage(
    prompt: int, completion: int, cached: int, reasoning: int = 0, drafts: tuple[int, int] = (0, 0)
) -> common_pb2.Usage:
    """drafts: speculative guesses checked, and accepted."""
    return common_pb2.Usage(
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
        reasoning_tokens=reasoning, draft_tokens=drafts[0], accepted_draft_tokens=drafts[1],
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
        speculative=f.speculative,
        kv_cache_dtype=f.kv_cache_dtype,
        tensor_parallel_size=f.tensor_parallel_size,
        score_method=_SCORE_METHODS.get(f.score_method or "", models_pb2.SCORE_METHOD_UNSPECIFIED),
        labels=f.labels,
        embedding_dimension=f.embedding_dimension,
    )
