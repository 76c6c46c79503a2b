"""Reasoning models, the output side: each choice's text -> its thought and its answer.

The model's reasoning parser (mmserve/processors/reasoning_parsers: named by the server's
--reasoning-parser, else implied by its chat template) splits the text; a ThinkTracker
follows the same on token ids, for usage.reasoning_tokens. Where the request has a
reasoning_budget or an output constraint, the engine gets the ReasoningGate too: it forces
`</think>` at the budget and starts the grammar after it (structured_output/reasoning.py).
Tool calls and the final text are read from the answer only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.params import SamplingParams
from mmserve.processors.reasoning_parsers import (
    ANSWER,
    NONE,
    ReasoningGate,
    ReasoningParser,
    ReasoningStream,
    ThinkTracker,
    find_state,
    get_reasoning_parser,
    reasoning_parser_for_model,
)


@dataclass(frozen=True)
class ReasoningOutput:
    """How one request's choices are read for their thought."""

    parser: ReasoningParser
    gate: ReasoningGate  # the token side, the budget included

    def stream(self) -> ChoiceReasoning:
        return ChoiceReasoning(self.parser.stream(self.gate.state), ThinkTracker(self.gate))

    def text_stream(self) -> ReasoningStream:
        """A text splitter alone (the tool stream's second detokenisation has its own)."""
        return self.parser.stream(self.gate.state)


class ChoiceReasoning:
    """One choice's deltas -> (thought text, answer text), with its reasoning token count."""

    def __init__(self, text: ReasoningStream, tokens: ThinkTracker) -> None:
        self._text = text
        self._tokens = tokens

    @property
    def reasoning_tokens(self) -> int:
        return self._tokens.reasoning_tokens

    def update(self, text: str, token_ids: Sequence[int], done: bool) -> tuple[str, str]:
        for token in token_ids:
            self._tokens.feed(token)
        thought, answer = self._text.feed(text)
        if done:
            more_thought, more_answer = self._text.finish()
            thought, answer = thought + more_thought, answer + more_answer
        return thought, answer


def find_reasoning_parser(chat_template: Any, forced: str | None) -> ReasoningParser | None:
    """The model's reasoning format: `forced` (the server's --reasoning-parser; "none" turns
    it off), else the one its chat template implies; None: not a reasoning model."""
    if forced == NONE:
        return None
    if isinstance(chat_template, dict):  # several named templates
        chat_template = "\n".join(str(t) for t in chat_template.values())
    template = chat_template if isinstance(chat_template, str) else None
    name = forced or reasoning_parser_for_model(template)
    return get_reasoning_parser(name) if name else None


def marker_ids(tokenizer: Any, marker: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(marker, add_special_tokens=False))


def reasoning_output(
    tokenizer: Any,
    prompt_token_ids: list[int],
    params: SamplingParams,
    forced: str | None = None,
    field: str = "params.reasoning_budget",
) -> ReasoningOutput | None:
    """The reading of a request's thought; None when the model has no reasoning format (a
    reasoning_budget is then InvalidArgument, naming `field`)."""
    parser = find_reasoning_parser(getattr(tokenizer, "chat_template", None), forced)
    end_ids = marker_ids(tokenizer, parser.end) if parser is not None else ()
    if parser is None or not end_ids:
        if params.reasoning_budget is not None:
            raise InvalidArgument(
                field, "this model has no reasoning format (the server can name one with "
                "--reasoning-parser)",
            )
        return None
    start_ids = marker_ids(tokenizer, parser.start)
    state = find_state(prompt_token_ids, start_ids, end_ids, parser.open_default)
    gate = ReasoningGate(state, start_ids, end_ids, parser.open_default, params.reasoning_budget)
    return ReasoningOutput(parser, gate)


def engine_gate(reasoning: ReasoningOutput | None, params: SamplingParams) -> ReasoningGate | None:
    """The gate the engine needs: only for a budget to force or a constraint to start after
    the thought; an output that starts in its answer needs none."""
    if reasoning is None or reasoning.gate.state == ANSWER:
        return None
    if params.reasoning_budget is None and params.structured is None:
        return None
    return reasoning.gate
