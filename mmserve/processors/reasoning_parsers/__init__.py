"""Reasoning parsers: the thought of a reasoning model (`<think> ... </think>`) apart from
its answer, one-shot or streamed; gate.py follows the same on token ids (budgets, grammars
that start after the thought, usage).

    parser = get_reasoning_parser(reasoning_parser_for_model(chat_template) or "qwen3")
    thought, answer = parser.parse(text, state)
    stream = parser.stream(state)              # one per output (choice)
    parts = stream.feed(text_delta) ... + stream.finish()

Formats (registry names): deepseek_r1 (always thinks), qwen3 (thinks when the template asks).
base.py states the contract both keep.
"""

from __future__ import annotations

import importlib

from mmserve.errors import InvalidArgument

from .base import ReasoningParser, ReasoningParts, ReasoningStream
from .gate import ANSWER, OPEN, THOUGHT, ReasoningGate, ThinkTracker, find_state

__all__ = [
    "ANSWER", "NONE", "OPEN", "THOUGHT", "ReasoningGate", "ReasoningParser", "ReasoningParts",
    "ReasoningStream", "ThinkTracker", "find_state", "get_reasoning_parser",
    "reasoning_parser_for_model", "reasoning_parser_names",
]  # fmt: skip

NONE = "none"  # the --reasoning-parser value that turns reasoning parsing off

# name -> (module, class), imported on first use
_PARSERS: dict[str, tuple[str, str]] = {
    "deepseek_r1": (".deepseek_r1", "DeepSeekR1Parser"),
    "qwen3": (".qwen3", "Qwen3Parser"),
}


def reasoning_parser_names() -> tuple[str, ...]:
    return tuple(sorted(_PARSERS))


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as `name`; InvalidArgument listing the valid names."""
    if name not in _PARSERS:
        valid = ", ".join((*reasoning_parser_names(), NONE))
        raise InvalidArgument(
            "reasoning_parser", f"unknown reasoning parser {name!r}; valid: {valid}"
        )
    module_name, class_name = _PARSERS[name]
    module = importlib.import_module(module_name, __name__)
    cls: type[ReasoningParser] = getattr(module, class_name)
    return cls()


# DeepSeek-R1's template: its assistant tag (fullwidth bars); the distills share it.
_DEEPSEEK_MARK = "<｜Assistant｜>"


def reasoning_parser_for_model(chat_template: str | None) -> str | None:
    """The reasoning format a chat template implies: one that mentions `<think>` thinks
    (deepseek_r1 for DeepSeek's template, else qwen3); None: not a reasoning model."""
    if not chat_template or "<think>" not in chat_template:
        return None
    return "deepseek_r1" if _DEEPSEEK_MARK in chat_template else "qwen3"
