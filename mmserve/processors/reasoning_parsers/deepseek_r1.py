"""DeepSeek-R1 and its distills: the model always thinks first. Newer templates open the
thought in the prompt (`<｜Assistant｜><think>\\n`); with older ones the output opens it.
Either way an output without markers is all thought (it ended before `</think>`)."""

from __future__ import annotations

from .base import ReasoningParser
from .gate import THOUGHT


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    open_default = THOUGHT
