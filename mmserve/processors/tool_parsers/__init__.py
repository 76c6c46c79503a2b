"""Tool-call parsers: model output text -> content and typed tool calls, one-shot or streamed.

    parser = get_parser(parser_for_model(chat_template, model_type) or "hermes")
    content, calls = parser.parse(text, accept)       # whole output
    stream = parser.stream(accept)                    # one per output (choice)
    deltas = stream.feed(text_delta) ... + stream.finish()

`accept(name, arguments)` says which parsed calls are calls (the request's tools); without
it every well-formed call is one, and untagged calls are not read. Formats (registry names):
hermes (`<tool_call>` JSON, Qwen/Hermes), llama3_json, mistral (`[TOOL_CALLS]`, before and
after v11), pythonic. base.py states the contract all of them keep. The markers
`<|python_tag|>`, `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`, `<|python_start|>` are special
tokens in their models: detokenise with skip_special_tokens=False for the text given to a
parser (ToolParser.markers lists a format's).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from mmserve.errors import InvalidArgument

from .base import (
    Accept,
    ContentDelta,
    Delta,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)

__all__ = [
    "Accept",
    "ContentDelta",
    "Delta",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_parser",
    "parser_for_model",
    "parser_names",
]

# name -> (module, class), imported on first use
_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": (".hermes", "HermesParser"),
    "llama3_json": (".llama3_json", "Llama3JsonParser"),
    "mistral": (".mistral", "MistralParser"),
    "pythonic": (".pythonic", "PythonicParser"),
}


def parser_names() -> tuple[str, ...]:
    return tuple(sorted(_PARSERS))


def get_parser(name: str, new_id: Callable[[], str] | None = None) -> ToolParser:
    """The parser registered as `name`; `new_id` makes call ids (default: the format's)."""
    if name not in _PARSERS:
        raise InvalidArgument(
            "tool_parser", f"unknown tool parser {name!r}; valid: {', '.join(parser_names())}"
        )
    module_name, class_name = _PARSERS[name]
    cls: type[ToolParser] = getattr(importlib.import_module(module_name, __name__), class_name)
    return cls(new_id)


# What a chat template says about its tool-call format, checked in this order: templates
# that mention several markers (Llama 4 has <|python_start|> and pythonic instructions)
# are told apart by the most specific one first.
_TEMPLATE_MARKERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("mistral", re.compile(re.escape("[TOOL_CALLS]"))),
    ("hermes", re.compile(re.escape("<tool_call>"))),
    ("pythonic", re.compile(r"<\|python_start\|>|\[func_name1\(|func_name\(param")),
    ("llama3_json", re.compile(r"<\|python_tag\|>|\"parameters\": ?dictionary")),
)

# Fallback by model_type (config.json) or architecture, lower-cased prefixes.
_MODEL_TYPES: tuple[tuple[str, str], ...] = (
    ("qwen", "hermes"),
    ("hermes", "hermes"),
    ("mistral", "mistral"),
    ("mixtral", "mistral"),
    ("ministral", "mistral"),
    ("llama4", "pythonic"),
    ("llama", "llama3_json"),
)


def parser_for_model(chat_template: str | None, model_type: str | None) -> str | None:
    """The tool parser for a model: from its chat template's text if that tells, else from
    its model_type / architecture name; None if unknown (the caller picks, or errors)."""
    if chat_template:
        for name, marker in _TEMPLATE_MARKERS:
            if marker.search(chat_template):
                return name
    kind = (model_type or "").lower()
    for prefix, name in _MODEL_TYPES:
        if kind.startswith(prefix):
            return name
    return None
