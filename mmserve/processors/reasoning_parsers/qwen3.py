"""Qwen3: thinks when asked (chat template_kwargs enable_thinking, default on). Its template
closes an empty thought in the prompt when thinking is off (`<think>\\n\\n</think>\\n\\n`), and
the Thinking-2507 models' template opens it (`<think>\\n`); otherwise the output opens it.
An output that opens no thought is all answer."""

from __future__ import annotations

from .base import ReasoningParser
from .gate import ANSWER


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    open_default = ANSWER
