"""Pure functions from OpenAI-style chat messages and tools to a Chat proto."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from mmserve_client._requests import GenerateKwargs, image, is_image, json_text
from mmserve_client.types import Image, ToolCall
from mmserve_client.v1 import common_pb2, generate_pb2

_MODES = {
    "auto": generate_pb2.ToolChoice.MODE_AUTO,
    "none": generate_pb2.ToolChoice.MODE_NONE,
    "required": generate_pb2.ToolChoice.MODE_REQUIRED,
}


class ChatOptions(TypedDict, total=False):
    """How to render a conversation (see chat_request for the accepted shapes)."""

    tools: Sequence[Mapping[str, Any]] | None  # tools the model may call
    tool_choice: str | Mapping[str, Any] | None  # default: "auto" with tools, else "none"
    add_generation_prompt: bool | None  # open an assistant turn; default true (false to continue)
    template_kwargs: Mapping[str, Any] | None  # allow-listed template variables
    continue_final_message: bool  # continue the last (assistant) message


class ChatKwargs(GenerateKwargs, ChatOptions, total=False):
    """Keyword arguments of chat/chat_stream: ChatOptions plus GenerateKwargs."""


def chat_from_kwargs(
    messages: Sequence[Mapping[str, Any]], kw: ChatKwargs
) -> tuple[generate_pb2.Chat, GenerateKwargs]:
    """Splits chat keyword arguments into the Chat they describe and the rest."""
    rest: dict[str, Any] = dict(kw)
    options = {k: rest.pop(k) for k in ChatOptions.__annotations__ if k in rest}
    return chat_request(messages, **options), rest  # type: ignore[return-value]


def chat_request(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    add_generation_prompt: bool | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> generate_pb2.Chat:
    """Builds a Chat from OpenAI-style message and tool dicts.

    A message: {"role", "content": str | list of parts, "tool_calls", "tool_call_id", "name",
    "reasoning_content" (or "reasoning_text": an assistant's earlier thinking)}.
    A part: a str (text); an image: encoded bytes, an Image, a pathlib.Path (a local file,
    read here) or a PIL image (sent as lossless PNG); {"type": "text", "text"};
    {"type": "image", "image": any image or a str local file path, "uuid"?};
    {"type": "image", "data" | "path" (server side, under its media dir) | "uuid"}; or
    {"type": "image_url", "image_url": {"url": "data:...;base64,..."}} (the server fetches
    no URLs). A tool: {"type": "function", "function": {...}} or the inner dict {"name",
    "description", "parameters" (dict or JSON text), "strict"}. tool_choice: "auto" |
    "none" | "required", a function name, or {"type": "function", "function": {"name"}}.
    template_kwargs values that are not str are sent as JSON text. continue_final_message:
    the prompt ends inside the last message (the assistant's), for the model to go on with it;
    add_generation_prompt then defaults to false (it opens a new turn instead).
    """
    out = generate_pb2.Chat(continue_final_message=continue_final_message)
    if add_generation_prompt is None and continue_final_message:
        add_generation_prompt = False
    out.messages.extend(_message(m) for m in messages)
    out.tools.extend(_tool(t) for t in tools or ())
    if tool_choice is not None:
        out.tool_choice.CopyFrom(_tool_choice(tool_choice))
    if add_generation_prompt is not None:
        out.add_generation_prompt = add_generation_prompt
    for key, value in (template_kwargs or {}).items():
        out.template_kwargs[key] = value if isinstance(value, str) else json.dumps(value)
    return out


def _message(m: Mapping[str, Any]) -> generate_pb2.Message:
    if "role" not in m:
        raise ValueError(f"a chat message needs a 'role': {dict(m)!r}")
    msg = generate_pb2.Message(
        role=m["role"],
        tool_call_id=m.get("tool_call_id") or "",
        name=m.get("name") or "",
        reasoning_text=m.get("reasoning_content") or m.get("reasoning_text") or "",
    )
    content = m.get("content")
    parts = [content] if isinstance(content, str) or is_image(content) else content or ()
    msg.content.extend(_part(p) for p in parts)
    msg.tool_calls.extend(_tool_call(c) for c in m.get("tool_calls") or ())
    return msg


def _part(p: Any) -> generate_pb2.ContentPart:
    if isinstance(p, str):
        return generate_pb2.ContentPart(text=p)
    if is_image(p):
        return generate_pb2.ContentPart(image=image(p))
    kind = p.get("type") if isinstance(p, Mapping) else None
    if kind == "text":
        return generate_pb2.ContentPart(text=p["text"])
    if kind == "image":
        return generate_pb2.ContentPart(image=_image_part(p))
    if kind == "image_url":
        url = p["image_url"]["url"] if isinstance(p["image_url"], Mapping) else p["image_url"]
        if not url.startswith("data:") or ";base64," not in url:
            raise ValueError("image_url must be a base64 data: URL; the server fetches no URLs")
        data = base64.b64decode(url.split(";base64,", 1)[1])
        return generate_pb2.ContentPart(image=common_pb2.Image(data=data))
    raise ValueError(f"unsupported content part: {p!r}")


def _image_part(p: Mapping[str, Any]) -> common_pb2.Image:
    uuid = p.get("uuid") or ""
    if "image" not in p:
        return image(Image(data=p.get("data"), path=p.get("path"), uuid=uuid))
    if "data" in p or "path" in p:
        raise ValueError("an image part takes one of 'image', 'data' or 'path'")
    value = p["image"]  # as in the offline API: a str is a local file path
    return image(Image.from_file(value) if isinstance(value, str) else value, uuid)


def _tool_call(c: ToolCall | Mapping[str, Any]) -> generate_pb2.ToolCall:
    if isinstance(c, ToolCall):
        return generate_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments)
    fn = c.get("function", c)
    args = fn.get("arguments", "")
    return generate_pb2.ToolCall(
        id=c.get("id", ""), name=fn["name"], arguments_json=json_text(args) if args else ""
    )


def _tool(t: Mapping[str, Any]) -> generate_pb2.Tool:
    fn = t.get("function", t)
    params = fn.get("parameters")
    return generate_pb2.Tool(
        name=fn["name"],
        description=fn.get("description") or "",
        parameters_json=json_text(params) if params is not None else "",
        strict=bool(fn.get("strict", False)),
    )


def _tool_choice(choice: str | Mapping[str, Any]) -> generate_pb2.ToolChoice:
    if isinstance(choice, str):
        if choice in _MODES:
            return generate_pb2.ToolChoice(mode=_MODES[choice])
        return generate_pb2.ToolChoice(function_name=choice)
    return generate_pb2.ToolChoice(function_name=choice.get("function", choice)["name"])
