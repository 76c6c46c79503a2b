"""Incremental detokenisation of one output stream, with stop strings.

Built on `tokenizers.decoders.DecodeStream`, which re-decodes a small window of recent
tokens at each step and returns only the new, complete text (None while a multi-byte
character is still split across tokens). Behaviour of DecodeStream (tokenizers 0.23) that
shapes this class:
- `step` returns None while the decoded window ends with U+FFFD, so a *real* U+FFFD at the
  end of the output, or bytes the model never completes, are never returned by it:
  `finish` decodes those held tokens itself.
- `step` returns None (not "") for a special token skipped with skip_special_tokens.
- `step` raises "Invalid prefix encountered" if decoding more tokens rewrites text it
  already returned (decoders with clean-up rules can); the stream is then restarted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from .stop_strings import StopStringMatcher

# Prompt tokens given to the stream as left context: enough for decoders that look back
# (e.g. SentencePiece's leading-space rule) without re-decoding the whole prompt.
PROMPT_CONTEXT_TOKENS = 8


class DetokOutput(NamedTuple):
    """What one update adds to the visible output. (A NamedTuple: made for every token of
    every request, and a third of the cost of a frozen dataclass.)"""

    text_delta: str  # new text, always whole characters; may be "" (held back)
    stopped_on: str | None  # the stop string that ended the output in this update, else None


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, honouring stop strings.

    Invariant: the concatenated deltas of all `update` calls plus `finish` equal the text of
    all output ids decoded at once (after the prompt, with the same skip_special_tokens),
    cut at the first stop string; it does not depend on how the ids were chunked.
    As in vLLM: no stop string may end in the text the first min_tokens ids release (text that a
    later id completes, such as a space in the token that begins an emoji, is that later id's; an
    output of at most min_tokens ids stops on none), and the EOS or stop token id that ended the
    output shows no text unless include_stop_str_in_output.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        hidden_ids: frozenset[int] = frozenset(),
    ) -> None:
        """hidden_ids: ids that show no text, whatever skip_special_tokens says (they still
        count towards min_tokens)."""
        self._backend: Tokenizer = tokenizer.backend_tokenizer
        self._skip_special = skip_special_tokens
        self._stop = StopStringMatcher(stop, include_stop_str_in_output)
        self._has_stops = any(stop)  # without stop strings the matcher releases text unchanged
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._hidden = hidden_ids
        self._num_ids = 0  # ids fed so far
        context = self._clean_context(list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]))
        self._stream = DecodeStream(context or None, skip_special_tokens=skip_special_tokens)
        # Ids of the last chunk the stream returned (left context for `finish`), and ids
        # fed since then that produced no text yet.
        self._chunk_ids: list[int] = context
        self._pending_ids: list[int] = []
        self._released: list[str] = []  # everything released so far, joined on demand
        self.finished = False  # set once a stop string matched or `finish` ran

    @property
    def output_text(self) -> str:
        """Everything released so far."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def stopped_on(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop.stopped_on

    def update(self, new_token_ids: Sequence[int], ends_on_stop_token: bool = False) -> DetokOutput:
        """Feed newly generated ids; return the text that became safe to show.
        ends_on_stop_token: the last id is the EOS or stop token id that ended the output."""
        if self.finished:
            return DetokOutput("", None)
        if ends_on_stop_token and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        # ids whose text no stop string may end in (min_tokens)
        quiet = min(max(self._min_tokens - self._num_ids, 0), len(new_token_ids))
        self._num_ids += len(new_token_ids)
        if quiet:
            early = self._release(self._text(new_token_ids[:quiet]), may_stop=False)
            late = self._release(self._text(new_token_ids[quiet:]))
            return DetokOutput(early.text_delta + late.text_delta, late.stopped_on)
        return self._release(self._text(new_token_ids))

    def finish(self) -> DetokOutput:
        """The output has ended: release everything still held (partial bytes as U+FFFD)."""
        if self.finished:
            return DetokOutput("", None)
        out = self._release(self._decode_pending(), self._num_ids > self._min_tokens)
        if self.finished:  # the pending text completed a stop string
            return out
        self.finished = True
        tail = self._stop.flush()
        self._released.append(tail)
        return DetokOutput(out.text_delta + tail, None)

    def _text(self, token_ids: Sequence[int]) -> str:
        # Step one id at a time: a partial character at the end of a batch of ids would
        # otherwise hold back the complete characters before it too.
        if len(token_ids) == 1:  # the usual step
            return self._step(token_ids[0])
        return "".join(self._step(token_id) for token_id in token_ids)

    def _release(self, text: str, may_stop: bool = True) -> DetokOutput:
        if not self._has_stops:
            self._released.append(text)
            return DetokOutput(text, None)
        delta, stopped_on = self._stop.push(text, may_stop)
        self._released.append(delta)
        if stopped_on is not None:
            self.finished = True
        return DetokOutput(delta, stopped_on)

    def _step(self, token_id: int) -> str:
        if token_id in self._hidden:
            return ""
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception as e:  # tokenizers raises a bare Exception for this
            if "Invalid prefix" not in str(e):
                raise
            return self._restart(token_id)
        if chunk is None:
            self._pending_ids.append(token_id)
            return ""
        if self._pending_ids:
            self._chunk_ids = self._pending_ids + [token_id]
            self._pending_ids = []
        else:
            self._chunk_ids = [token_id]
        return chunk

    def _restart(self, token_id: int) -> str:
        # Text already released cannot be taken back: decode the ids not yet shown with a
        # fresh stream, without left context (a fresh stream has no prefix to contradict).
        ids = self._pending_ids + [token_id]
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        self._chunk_ids, self._pending_ids = [], []
        return "".join(self._step(i) for i in ids)

    def _decode_pending(self) -> str:
        if not self._pending_ids:
            return ""
        pending, self._pending_ids = self._pending_ids, []
        before = self._decode(self._chunk_ids)
        after = self._decode(self._chunk_ids + pending)
        return after[len(before) :] if after.startswith(before) else self._decode(pending)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def _clean_context(self, context: list[int]) -> list[int]:
        # A prompt ending inside a multi-byte character would make the first output token
        # rewrite the context's text (an invalid prefix): drop such a partial tail.
        while context and self._decode(context).endswith("\ufffd"):
            context.pop()
        return context
