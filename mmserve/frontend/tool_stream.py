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
from mmserve.frontend.tools import ToolRequest, special_markers
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
from mmserve.processors.tool_parsers.base import json_call, random_call_id
from mmserve.processors.tool_parsers.scan import BalancedScanner, Scan
from mmserve.structured_output.vocab import special_token_ids


class ForcedCallStream(StreamingToolParser):
    """The output of a forced tool_choice: one call object or an array of calls. Each call
    is emitted as soon as its object closes (a call object cannot grow once its braces
    close, so the deltas do not depend on chunking); what does not parse as calls (JSON cut
    short by max_tokens, a call the request does not accept) stays content, from the end of
    the last call on. An output with no call at all is content as it is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._array = False  # the output is an array of calls (else one call object)
        self._scanner = BalancedScanner(0)

    def _start(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            return self._end_of_output() if reader.final else False
        if reader.peek(1) == "[":
            reader.pos += 1
            self._array = True
        self._state = self._item
        return True

    def _item(self) -> bool:
        """Where a call may start; in an array, also its `,` or `]`."""
        reader = self._in
        if not reader.skip_ws():
            return self._end_of_output() if reader.final else False
        head = reader.peek(1)
        if self._array and head in (",", "]"):
            reader.pos += 1
            self._state = self._item if head == "," else self._done
            return True
        self._scanner = BalancedScanner(reader.pos, opening="{")
        self._state = self._value
        return True

    def _value(self) -> bool:
        reader, scanner = self._in, self._scanner
        state = self._scan(scanner)
        if state is None:
            return False
        call = json_call(self._json_of(scanner)) if state is Scan.END else None
        if call is None or not self._accepts(*call):
            return self._all_content()
        reader.pos = reader.keep = scanner.pos
        self._call(*call)
        self._state = self._item if self._array else self._done
        return True

    def _done(self) -> bool:
        reader = self._in
        if not reader.skip_ws():
            return self._end_of_output() if reader.final else False
        return self._all_content()

    def _end_of_output(self) -> bool:
        """What is left after the last call (JSON punctuation, whitespace) is dropped; with
        no call at all, the output is content."""
        if self._calls:
            self._in.keep = self._in.pos = self._in.end
        return self._all_content()


@dataclass(frozen=True)
class ToolOutput:
    """How one request's choices are read for tool calls."""

    request: ToolRequest
    parser: ToolParser | None  # the model's format; None under a forced tool_choice
    new_id: Callable[[], str]  # call ids in the model's style (Mistral wants 9 characters)
    accept: Accept  # which parsed calls are calls (tools.ToolRequest.accept)
    # a detokeniser keeping the markers (it shows no other special token)
    retext: Callable[[], IncrementalDetokenizer] | None

    def stream(self, split: Callable[[], ReasoningStream] | None = None) -> ChoiceToolStream:
        """One choice's reading; `split`: a reasoning model's text splitter, for the second
        detokenisation (the engine's text comes split already: its answer only)."""
        if self.parser is None:
            parser: StreamingToolParser = ForcedCallStream(self.new_id, self.accept)
        else:
            parser = self.parser.stream(self.accept)
        detok = self.retext() if self.retext else None
        return ChoiceToolStream(parser, detok, split() if detok and split else None)


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
        return ToolOutput(request, None, new_id, request.accept(), None)
    if parser is None:
        raise InvalidArgument(
            "chat.tools",
            "no tool-call parser is known for this model's chat template or architecture; "
            "the server can name one with --tool-parser (or use tool_choice required)",
        )
    special = special_token_ids(tokenizer)
    markers = special_markers(parser, tokenizer, special)
    retext = None
    if params.skip_special_tokens and markers:
        retext = functools.partial(
            IncrementalDetokenizer,
            tokenizer,
            list(prompt_token_ids),
            skip_special_tokens=False,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            hidden_ids=frozenset(special - markers),
        )
    return ToolOutput(request, parser, new_id, request.accept(), retext)


class ChoiceToolStream:
    """One choice's deltas -> (content text, tool-call deltas)."""

    def __init__(
        self,
        parser: StreamingToolParser,
        detok: IncrementalDetokenizer | None,
        split: ReasoningStream | None = None,
    ) -> None:
        self._parser = parser
        self._detok = detok  # None: parse the engine's text
        self._split = split  # the second detokenisation's thought apart from its answer
        self.num_calls = 0

    def update(
        self, text: str, token_ids: Sequence[int], done: bool, on_stop_token: bool = False
    ) -> tuple[str, list[ToolCallDelta]]:
        """A choice's news (its GenerationDelta's text and token ids; done: it finished;
        on_stop_token: the last id is the EOS or stop token id that ended it) -> (content
        text, tool-call deltas)."""
        if self._detok is not None:
            text = self._retext(token_ids, done, on_stop_token)
        out = self._parser.feed(text)
        if done:
            out += self._parser.finish()
        calls = [d for d in out if isinstance(d, ToolCallDelta)]
        self.num_calls += len(calls)
        return "".join(d.text for d in out if isinstance(d, ContentDelta)), calls

    def _retext(self, token_ids: Sequence[int], done: bool, on_stop_token: bool) -> str:
        assert self._detok is not None
        text = self._detok.update(token_ids, on_stop_token).text_delta
        text = text + self._detok.finish().text_delta if done else text
        if self._split is None:
            return text
        answer = self._split.feed(text)[1]
        return answer + self._split.finish()[1] if done else answer
