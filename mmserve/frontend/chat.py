"""Chats into prompts, and how their tool calls are read: the chat side of the front end.

A chat is rendered with the model's template (arbitrary jinja, sandboxed and bounded:
mmserve/processors/chat_template.py), tokenised, and each image's placeholder expanded to its tokens
(frontend/images.py). Its tool_choice becomes, under a forced choice, the output constraint
and, in every mode with tools, the reading of the output (tool_stream.py). The server and the
offline LLM both come through here; neither renders a template itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.frontend.images import ImagePrompts
from mmserve.frontend.tool_stream import ToolOutput, tool_output
from mmserve.frontend.tools import (
    ToolRequest,
    find_tool_parser,
    forced_constraint,
    strict_call_tags,
)
from mmserve.inputs import MMInput
from mmserve.params import SamplingParams
from mmserve.processors.chat_template import render_and_tokenize
from mmserve.processors.images import DecodedImage


@dataclass
class ChatInput:
    """A chat as the front end takes it (the server converts the Chat proto into one)."""

    messages: list[dict[str, Any]]  # OpenAI-style message dicts; an image part is {"type": "image"}
    tools: list[dict[str, Any]] | None = None  # OpenAI-style function tools; None = no tools
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # end inside the last (assistant) message, to go on
    template_kwargs: dict[str, object] = field(default_factory=dict)  # checked by the template
    tool_request: ToolRequest | None = None  # what is asked of tool calls; None = no calls
    image_fields: list[str] = field(default_factory=list)  # each image part's field, in order


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat, ready for FrontEnd.validate."""

    text: str  # the template's output (images as their single placeholder each)
    token_ids: list[int]  # images expanded to their tokens
    mm_inputs: tuple[MMInput, ...] = ()  # one per image, in order


def render(
    tokenizer: Any,
    images: ImagePrompts | None,
    chat: ChatInput,
    decoded: Sequence[DecodedImage] = (),
    time_limit_ms: int | None = None,
    max_tokens: int | None = None,
) -> ChatPrompt:
    """The chat's prompt; `decoded`: its images, in the order of chat.image_fields (None
    images: the model reads none). Blocking (templates, tokenising, image preprocessing): call
    it off the event loop. InvalidArgument names the field; a template still rendering after
    time_limit_ms (None: no limit) is stopped, and InvalidArgument names "chat". max_tokens:
    a rendered text found far past it is not tokenised (TooManyTokens; None: no limit)."""
    if len(decoded) != len(chat.image_fields):
        raise ValueError(f"{len(decoded)} images for {len(chat.image_fields)} image parts")
    if chat.image_fields and images is None:
        raise InvalidArgument(chat.image_fields[0], "this model does not read images")
    text, ids = render_and_tokenize(
        tokenizer,
        chat.messages,
        chat.add_generation_prompt,
        chat.tools,
        chat.template_kwargs,
        allow_images=bool(chat.image_fields),
        continue_final_message=chat.continue_final_message,
        time_limit_ms=time_limit_ms,
        max_tokens=max_tokens,
    )
    if not decoded or images is None:
        return ChatPrompt(text, ids)
    ids, mm_inputs = images.process(ids, decoded, chat.image_fields)
    return ChatPrompt(text, ids, mm_inputs)


def read_tools(
    request: ToolRequest,
    tokenizer: Any,
    architecture: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    backend: str,
    parser_name: str | None = None,
) -> ToolOutput:
    """How the output is read for calls. Under a forced tool_choice this also sets its
    constraint on params (with `backend`); a request's own constraint cannot be combined
    with it. parser_name: a parser named by the operator, over the one the model's chat
    template or architecture implies."""
    parser = find_tool_parser(tokenizer.chat_template, architecture, parser_name)
    if request.forced:
        if params.structured is not None:
            raise InvalidArgument(
                f"structured.{params.structured.kind}",
                "cannot be combined with a forced chat.tool_choice (it constrains the output)",
            )
        params.structured = forced_constraint(request, backend)
    elif params.structured is None:  # under auto: strict tools' calls, where it can
        params.structured = strict_call_tags(request, parser, tokenizer, backend)
    return tool_output(request, parser, tokenizer, prompt_token_ids, params)
