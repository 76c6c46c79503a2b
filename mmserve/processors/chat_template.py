"""Chat messages -> prompt text and token ids, through the model's own chat template.

Rendering is transformers' `apply_chat_template`, which runs the template in jinja2's
ImmutableSandboxedEnvironment (templates come from model repos: untrusted code), under a time
limit when given one (time_limit.py: the sandbox bounds what a template may touch, not how
long it runs). Everything a request can put into the template is validated here first, naming
the offending field; a template that runs out of time, recursion or range is the "chat"'s.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

from jinja2.exceptions import SecurityError, TemplateError
from transformers import PreTrainedTokenizerFast

from mmserve.errors import InvalidArgument, UnsupportedModel
from mmserve.processors.content_parts import ContentFormat, content_format
from mmserve.processors.long_texts import TooManyTokens, find_long_text
from mmserve.processors.time_limit import TimeLimitExceeded, call_with_time_limit

P = ParamSpec("P")
T = TypeVar("T")

# "developer": OpenAI's name for system instructions; rendered as "system" for a template that
# does not name the role itself
ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
)
_IMAGE_PART_TYPES = frozenset({"image", "image_url"})  # for models that read images


def _parse_bool(name: str, value: object) -> bool:
    # Values may arrive as strings: the proto field is map<string, string>.
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidArgument("template_kwargs", f"{name} must be true or false, got {value!r}")


def _parse_effort(name: str, value: object) -> str:
    if value in ("low", "medium", "high"):
        return str(value)
    raise InvalidArgument("template_kwargs", f"{name} must be low, medium or high, got {value!r}")


_MAX_KWARG_TEXT = 64  # characters of a text template variable (a date, a tool's name)


def _parse_text(name: str, value: object) -> str:
    if isinstance(value, str) and 0 < len(value) <= _MAX_KWARG_TEXT and value.isprintable():
        return value
    raise InvalidArgument(
        "template_kwargs", f"{name} must be printable text of 1 to {_MAX_KWARG_TEXT} characters"
    )


def _parse_names(name: str, value: object) -> list[str]:
    # a JSON list arrives parsed (the proto's values are JSON text)
    if isinstance(value, list) and len(value) <= 16:
        return [_parse_text(name, v) for v in value]
    raise InvalidArgument("template_kwargs", f"{name} must be a JSON list of at most 16 names")


# Template variables a request may set, each with its parser. Anything else is refused: a
# template sees these next to bos_token etc., which a request must not be able to override.
TEMPLATE_KWARGS: Mapping[str, Callable[[str, object], object]] = {
    "enable_thinking": _parse_bool,  # Qwen3-style thinking switch
    "reasoning_effort": _parse_effort,  # gpt-oss-style effort level
    "tools_in_user_message": _parse_bool,  # Llama 3.x: tools in the first user turn or system
    "date_string": _parse_text,  # Llama 3.x: "Today Date" in the system turn
    "builtin_tools": _parse_names,  # Llama 3.1: ["brave_search", "wolfram_alpha"]
    "add_vision_id": _parse_bool,  # Qwen2-VL: "Picture 1:" before each image
}


def render_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, object] | None = None,
    *,
    continue_final_message: bool = False,
    time_limit_ms: int | None = None,
) -> str:
    """Render messages into the prompt text with the model's chat template.

    continue_final_message: end the prompt inside the last (assistant) message, for the model
    to go on with it, as transformers' apply_chat_template(continue_final_message=True) does.
    time_limit_ms: the render's budget (None: unbounded); past it, InvalidArgument on "chat".
    """
    args = _template_args(
        tokenizer, messages, add_generation_prompt, tools, template_kwargs,
        continue_final_message=continue_final_message,
    )
    return str(_bounded(time_limit_ms, _apply, tokenizer, args, tokenize=False))


def render_and_tokenize(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, object] | None = None,
    sanitize_control_tokens: bool = True,
    allow_images: bool = False,
    *,
    continue_final_message: bool = False,
    time_limit_ms: int | None = None,
    max_tokens: int | None = None,
) -> tuple[str, list[int]]:
    """Render messages and tokenise the prompt; returns (prompt_text, token_ids).

    Tokenised without adding special tokens: the template writes BOS itself if the model
    wants one. With sanitize_control_tokens, control tokens written *inside* message text
    (say a user typing "<|im_end|>") become plain text tokens, so a user cannot forge turn
    boundaries; only the template's own control tokens are encoded as such. With
    allow_images, {"type": "image"} parts reach the template, which places the model's image
    token for each (ImagePrompts expands them). continue_final_message and time_limit_ms: as
    for render_chat (the limit covers rendering and tokenising together). max_tokens: a
    prompt found far past it from a head of its text is not tokenised (TooManyTokens); None:
    any length.
    """
    args = _template_args(
        tokenizer, messages, add_generation_prompt, tools, template_kwargs, allow_images,
        continue_final_message,
    )
    return _bounded(
        time_limit_ms, _render_and_encode, tokenizer, args, sanitize_control_tokens, max_tokens
    )


def _render_and_encode(
    tokenizer: PreTrainedTokenizerFast,
    args: dict[str, Any],
    sanitize_control_tokens: bool,
    max_tokens: int | None,
) -> tuple[str, list[int]]:
    # Rendered twice when sanitising (transformers marks user strings before rendering);
    # both see the same validated inputs, so they agree (unless the template prints the time).
    text = str(_apply(tokenizer, args, tokenize=False))
    if max_tokens is not None:
        # plain tokens of the text: a sanitised control token is as many tokens or more
        def encode(part: str) -> list[int]:
            return list(tokenizer.encode(part, add_special_tokens=False))

        long = find_long_text(encode, text, max_tokens)
        if long is not None:
            raise TooManyTokens(long.at_least)
    if sanitize_control_tokens:
        ids = _apply(tokenizer, args, tokenize=True, sanitize_control_tokens=True)
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text, list(ids)


def _bounded(time_limit_ms: int | None, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    if time_limit_ms is None:
        return fn(*args, **kwargs)
    try:
        return call_with_time_limit(time_limit_ms / 1000, fn, *args, **kwargs)
    except TimeLimitExceeded:
        raise InvalidArgument(
            "chat", f"the model's chat template did not finish within {time_limit_ms} ms"
        ) from None


def _template_args(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, object] | None,
    allow_images: bool = False,
    continue_final_message: bool = False,
) -> dict[str, Any]:
    if not tokenizer.chat_template:
        raise InvalidArgument("chat", "this model has no chat template; send a prompt instead")
    args: dict[str, Any] = parse_template_kwargs(template_kwargs or {})
    args["tools"] = validate_tools(tools) if tools else None
    template = tokenizer.get_chat_template(None, args["tools"])
    # A template that ignores tools would silently drop them: refuse instead.
    if tools and "tools" not in template:
        raise InvalidArgument("tools", "this model's chat template does not support tools")
    args["conversation"] = validate_messages(messages, allow_images, content_format(template))
    if "developer" not in template:  # a template that does not know the role reads system
        for message in args["conversation"]:
            if message["role"] == "developer":
                message["role"] = "system"
    args["add_generation_prompt"] = add_generation_prompt
    if continue_final_message:
        _check_continuable(args["conversation"], add_generation_prompt, template)
        args["continue_final_message"] = True
    return args


def _check_continuable(
    conversation: list[dict[str, Any]], add_generation_prompt: bool, template: str
) -> None:
    """transformers' conditions for continue_final_message, checked before rendering so that
    each is named; and the API's own: the message to continue is the assistant's."""
    field = "continue_final_message"
    if add_generation_prompt:
        raise InvalidArgument(field, "needs add_generation_prompt false (it opens a new turn)")
    last = conversation[-1]
    if last["role"] != "assistant":
        raise InvalidArgument(field, f"the last message must be the assistant's, not {last['role']}")
    content = last.get("content")
    if content is None or (not content and "tool_calls" in last):  # (a call-only turn's "")
        raise InvalidArgument(field, "the last message has no content to continue")
    if isinstance(content, list) and not any(p["type"] == "text" for p in content):
        raise InvalidArgument(field, "the last message has no text to continue")
    if "content" not in template:
        raise InvalidArgument(field, "this model's chat template does not render message content")


def _apply(tokenizer: PreTrainedTokenizerFast, args: dict[str, Any], **options: Any) -> Any:
    try:
        return tokenizer.apply_chat_template(**args, return_dict=False, **options)
    except SecurityError as e:  # subclass of TemplateError: the model is at fault, not the user
        raise UnsupportedModel(f"chat template tried an unsafe operation: {e}") from e
    except (TemplateError, TypeError) as e:
        # raise_exception() in templates reports conversation rules (e.g. roles must
        # alternate); a TypeError is a message shape the template cannot handle.
        raise InvalidArgument("messages", f"rejected by the model's chat template: {e}") from e
    except (RecursionError, OverflowError) as e:  # jinja's sandbox caps range() (OverflowError)
        raise InvalidArgument("chat", f"the model's chat template failed: {e}") from e
    except (ValueError, ArithmeticError, LookupError, AttributeError) as e:
        # what transformers cannot check before rendering: the template must print the last
        # message as it is, for the prompt to end inside it
        continuing = args.get("continue_final_message") and isinstance(e, ValueError)
        if continuing and "continue_final_message" in str(e):
            raise InvalidArgument(
                "continue_final_message",
                "the model's chat template alters the last message, so it cannot be continued",
            ) from e
        # a template's own Python error on this conversation (content.index('</think>') on a
        # message without one, a division by zero); elsewhere it is ours and stays INTERNAL
        if _raised_by_template(e):
            raise InvalidArgument("messages", f"rejected by the model's chat template: {e}") from e
        raise


def _raised_by_template(e: BaseException) -> bool:
    # jinja compiles templates from strings under the file name "<template>"
    return any(f.filename == "<template>" for f in traceback.extract_tb(e.__traceback__))


def parse_template_kwargs(kwargs: Mapping[str, object]) -> dict[str, object]:
    """Check names against the allow-list and parse values; raises InvalidArgument."""
    parsed: dict[str, object] = {}
    for name, value in kwargs.items():
        parser = TEMPLATE_KWARGS.get(name)
        if parser is None:
            allowed = ", ".join(sorted(TEMPLATE_KWARGS))
            raise InvalidArgument("template_kwargs", f"unknown key {name!r}; allowed: {allowed}")
        parsed[name] = parser(name, value)
    return parsed


def validate_messages(
    messages: Sequence[Mapping[str, Any]],
    allow_images: bool = False,
    content: ContentFormat = "string",
) -> list[dict[str, Any]]:
    """Check roles, keys and content; return plain-dict copies ready for the template.
    content: how the template reads content (content_format): text-only part lists stay
    lists for "parts", and strings become one text part for "parts_only"."""
    if not messages:
        raise InvalidArgument("messages", "must not be empty")
    return [
        _validate_message(f"messages[{i}]", m, allow_images, content)
        for i, m in enumerate(messages)
    ]


def _validate_message(
    field: str, message: Mapping[str, Any], allow_images: bool, content_as: ContentFormat
) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidArgument(field, "must be an object with role and content")
    unknown = sorted(set(message) - _MESSAGE_KEYS)
    if unknown:
        raise InvalidArgument(
            f"{field}.{unknown[0]}", f"unknown key; allowed: {sorted(_MESSAGE_KEYS)}"
        )
    role = message.get("role")
    if role not in ROLES:
        raise InvalidArgument(f"{field}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": role}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = _string(f"{field}.{key}", message[key])
    if message.get("tool_calls"):
        if role != "assistant" or not isinstance(message["tool_calls"], list):
            raise InvalidArgument(f"{field}.tool_calls", "must be a list, on assistant messages")
        out["tool_calls"] = [
            _validate_tool_call(f"{field}.tool_calls[{j}]", c)
            for j, c in enumerate(message["tool_calls"])
        ]
    content = message.get("content")
    if content is not None:
        # tool results stay strings, as vLLM passes them: few templates read their parts
        as_format: ContentFormat = "string" if role == "tool" else content_as
        out["content"] = _flatten_content(f"{field}.content", content, allow_images, as_format)
    elif "tool_calls" in out:
        # A call without text (OpenAI's content null) has empty content, as vLLM renders it:
        # templates read content unguarded (Qwen3's `'</think>' in message.content`).
        out["content"] = ""
    else:
        raise InvalidArgument(f"{field}.content", "is required")
    return out


def _flatten_content(
    field: str, content: Any, allow_images: bool, content_as: ContentFormat
) -> str | list[dict[str, str]]:
    # Text-only part lists become one string (joined by newlines, as vLLM does) unless the
    # template reads parts (content_parts.py): most templates expect strings, and many
    # (SmolLM2's included) break on lists or print them as Python reprs. With images the list
    # stays, as [{"type": "text", "text"}, {"type": "image"}, ...]. A string stays one unless
    # the template reads only lists, where it would render as nothing.
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content_as == "parts_only" else content
    if not isinstance(content, list):
        raise InvalidArgument(field, "must be a string or a list of parts")
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _IMAGE_PART_TYPES:
            if not allow_images:
                raise InvalidArgument(f"{field}[{j}]", "image parts are not supported by this model")
            parts.append({"type": "image"})  # the pixels travel beside the messages
            continue
        if kind != "text":
            raise InvalidArgument(f"{field}[{j}].type", f"must be 'text', got {kind!r}")
        parts.append({"type": "text", "text": _string(f"{field}[{j}].text", part.get("text"))})
    if content_as == "string" and all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _validate_tool_call(field: str, call: Any) -> dict[str, Any]:
    """OpenAI shape {id, type, function: {name, arguments}}; arguments become a dict.

    HF templates serialise `arguments` with `tojson` themselves, so the JSON string an
    OpenAI-style client sends must be parsed first or it would be encoded twice.
    """
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise InvalidArgument(f"{field}.function", "must be an object with name and arguments")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"{field}.function.arguments", f"invalid JSON: {e}") from e
    if not isinstance(arguments, Mapping):
        raise InvalidArgument(f"{field}.function.arguments", "must be a JSON object")
    name = _string(f"{field}.function.name", function.get("name"))
    out = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
    if call.get("id") is not None:
        out["id"] = _string(f"{field}.id", call["id"])
    return out


def validate_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tools as JSON-schema function specs: {type: function, function: {name, ...}}."""
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            raise InvalidArgument(f"tools[{i}].function", "must be an object with a name")
        _string(f"tools[{i}].function.name", function.get("name"))
        if not isinstance(function.get("parameters", {}), Mapping):
            raise InvalidArgument(f"tools[{i}].function.parameters", "must be a JSON schema object")
        out.append({"type": "function", "function": dict(function)})
    return out


def _string(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(field, f"must be a string, got {type(value).__name__}")
    return value
