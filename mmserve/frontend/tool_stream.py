"""Tool calling, the output side: each choice's new tokens and text -> content and calls.

Under tool_choice auto the model's parser reads the text. Some formats mark calls with
special tokens (`<|python_tag|>`, `[TOOL_CALLS]`), which the engine's text drops under
skip_special_tokens (the default). For such a model the choice's tokens are detokenised a
second time here, with every special token removed *except* the format's markers: the
parser sees the markers, the client sees no control tokens, and the engine's own text is
left as the request asked. (Stop strings are matched on that text as well; it differs from
the engine's only by the markers.) Where the markers are plain text, or the request keeps
special tokens, the engine's text is parsed as it is.

Under a forced tool_choice the output is JSON in the shape tools.py builds a schema for:
a call object or an array of them, each call emitted as its object closes (ForcedCallStream).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.frontend.tools import ToolRequest
from mmserve.params import SamplingParams
from mmserve.processors.detokenizer import IncrementalDetokenizer
from mmserve.processors.reasoning_parsers import ReasoningStream
from mmserve.processors.tool_parsers import (
    Accept,
    ContentDelta,
    StreamingToolParser,
    ToolCallDelta,
    ToolParser,
)
from mmserve.processors.tool_parsers.base import (
    arguments_of,
    canonical_arguments,
    decode_json_prefix,
    random_call_id,
)
from mmserve.structured_output.vocab import special_token_ids


class ForcedCallStream(StreamingToolParser):
    """The output of a forced tool_choice: one call object or an array of calls. Each call
    is emitted as soon as its object closes (a call object cannot grow once its braces
    close, so the deltas do not depend on chunking); what does not parse as calls (JSON cut
    short by max_tokens, a call the request does not accept) stays content."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = "start"  # start -> array (calls one by one) -> done; or "content"
        self._held = ""  # JSON punctuation read since the last call: content if no call follows

    def _step(self) -> bool:
        buf = self._buf
        body = buf.lstrip()
        if self._state == "content" or (self._state == "done" and body):
            self._to_content(self._take(len(buf)))
            return False
        if not body:
            if self._final:
                self._take(len(buf))  # whitespace around the JSON
            return False
        if self._state == "start":
            self._state = "array" if body[0] == "[" else "object"
            self._held += self._take(len(buf) - len(body) + (body[0] == "["))
            return True
        if self._state == "array" and body[0] in ",]":
            self._state = "done" if body[0] == "]" else "array"
            self._held += self._take(len(buf) - len(body) + 1)
            return True
        return self._next_call(len(buf) - len(body))

    def _next_call(self, skip: int) -> bool:
        """Decodes one complete call object at buf[skip:]; False when it is not complete."""
        try:
            value, end = decode_json_prefix(self._buf, skip)
        except ValueError:
            if self._final:  # cut short: the rest is content
                self._to_content(self._take(len(self._buf)))
            return False
        call = _forced_call(value)
        text = self._take(end)
        if call is None or not self._accepts(*call):
            self._to_content(text)
            return True
        self._held = ""
        self._call(*call)
        if self._state == "object":
            self._state = "done"
        return True

    def _to_content(self, text: str) -> None:
        """From here on the output is content, the punctuation held back included."""
        self._state = "content"
        self._content(self._held + text)
        self._held = ""


def _forced_call(value: object) -> tuple[str, str] | None:
    """(name, canonical arguments) of one call object, or None."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = canonical_arguments(arguments_of(value))
    return None if arguments is None else (name, arguments)


@dataclass(frozen=True)
class ToolOutput:
    """How one request's choices are read for tool calls."""

    request: ToolRequest
    parser: ToolParser | None  # the model's format; None under a forced tool_choice
    new_id: Callable[[], str]  # call ids in the model's style (Mistral wants 9 characters)
    accept: Accept  # which parsed calls are calls (tools.ToolRequest.accept)
    retext: Callable[[], IncrementalDetokenizer] | None  # a detokeniser keeping the markers
    drop_ids: frozenset[int]  # token ids the second detokenisation leaves out

    def stream(self, split: Callable[[], ReasoningStream] | None = None) -> ChoiceToolStream:
        """One choice's reading; `split`: a reasoning model's text splitter, for the second
        detokenisation (the engine's text comes split already: its answer only)."""
        if self.parser is None:
            parser: StreamingToolParser = ForcedCallStream(self.new_id, self.accept)
        else:
            parser = self.parser.stream(self.accept)
        detok = self.retext() if self.retext else None
        return ChoiceToolStream(parser, detok, self.drop_ids, split() if detok and split else None)


def tool_output(
    request: ToolRequest,
    parser: ToolParser | None,
    tokenizer: Any,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
) -> ToolOutput:
    """The reading of a request's output; `parser` is the model's (None if unknown, which
    only a forced tool_choice can do without)."""
    new_id = parser.new_id if parser is not None else random_call_id
    if request.forced:
        return ToolOutput(request, None, new_id, request.accept(), None, frozenset())
    if parser is None:
        raise InvalidArgument(
            "chat.tools",
            "no tool-call parser is known for this model's chat template or architecture; "
            "the server can name one with --tool-parser (or use tool_choice required)",
        )
    special = special_token_ids(tokenizer)
    added = tokenizer.added_tokens_encoder  # content -> id; special tokens are added tokens
    markers = {added[m] for m in parser.markers if m in added} & special
    retext = None
    if params.skip_special_tokens and markers:
        retext = functools.partial(
            IncrementalDetokenizer,
            tokenizer,
            list(prompt_token_ids),
            skip_special_tokens=False,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
    return ToolOutput(request, parser, new_id, request.accept(), retext, special - markers)


class ChoiceToolStream:
    """One choice's deltas -> (content text, tool-call deltas)."""

    def __init__(
        self,
        parser: StreamingToolParser,
        detok: IncrementalDetokenizer | None,
        drop_ids: frozenset[int],
        split: ReasoningStream | None = None,
    ) -> None:
        self._parser = parser
        self._detok = detok  # None: parse the engine's text
        self._drop_ids = drop_ids
        self._split = split  # the second detokenisation's thought apart from its answer
        self.num_calls = 0

    def update(
        self, text: str, token_ids: Sequence[int], done: bool
    ) -> tuple[str, list[ToolCallDelta]]:
        """A choice's news (its GenerationDelta's text and token ids; done: it finished) ->
        (content text, tool-call deltas)."""
        if self._detok is not None:
            text = self._retext(token_ids, done)
        out = self._parser.feed(text)
        if done:
            out += self._parser.finish()
        calls = [d for d in out if isinstance(d, ToolCallDelta)]
        self.num_calls += len(calls)
        return "".join(d.text for d in out if isinstance(d, ContentDelta)), calls

    def _retext(self, token_ids: Sequence[int], done: bool) -> str:
        assert self._detok is not None
        text = self._detok.update([t for t in token_ids if t not in self._drop_ids]).text_delta
        text = text + self._detok.finish().text_delta if done else text
        if self._split is None:
            return text
        answer = self._split.feed(text)[1]
        return answer + self._split.finish()[1] if done else answer

