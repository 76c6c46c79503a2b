"""The outlines backend (outlines-core): JSON schema, JSON object, regex and choice.

Everything compiles to a regex and then to a token-level automaton (`Index`), offline: the
vocabulary is built here from the tokenizer (vocab.py), never downloaded. EBNF grammars
are refused: outlines-core has no context-free engine (the `outlines` package hands CFGs
to llguidance, a different engine) - use the xgrammar backend for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from outlines_core import Guide, Index, Vocabulary
from transformers import PreTrainedTokenizerFast

from mmserve.errors import InvalidArgument

from .backend import (
    MAX_ROLLBACK_TOKENS,
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
    allow_tokens,
    bitmask_width,
)
from .keywords import OUTLINES_RULES
from .outlines_worker import (
    END_MARK,
    END_MARK_TOKEN_ID,
    BuildTimeout,
    IndexBuilder,
    Job,
    SchemaJob,
)
from .params import StructuredOutputParams
from .prepare import prepare_schema
from .regex_check import RegexProblem, strip_anchors
from .schema_check import parse_schema
from .schema_tree import RelaxedKeyword
from .vocab import token_bytes

# The most an Index build may take (under the grammar cache's limit, so that this error,
# naming the backend, is the one reported, and the build is stopped: outlines_worker.py).
BUILD_TIMEOUT_S = 8.0

# Characters with a meaning in outlines-core's (Rust) regex syntax; a backslash before any
# of them is accepted by both Rust's and Python's regex parsers.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


class OutlinesBackend(StructuredOutputBackend):
    name = "outlines"

    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        if not eos_token_ids:
            raise ValueError("the outlines backend needs at least one eos token id")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._builder = IndexBuilder(
            _vocabulary(tokenizer, vocab_size, eos_token_ids), BUILD_TIMEOUT_S
        )

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        params.validate()
        job, relaxed = self._job_for(params)
        try:
            index = self._builder.build(job)
        except ValueError as e:  # outlines-core's message (regex syntax, unsupported feature)
            raise InvalidArgument(params.field, str(e)) from None
        except BuildTimeout as e:
            raise InvalidArgument(
                params.field,
                f"took too long to compile with the outlines backend ({e}; stopped): simplify "
                "it (long maxLength, many optional properties) or use the xgrammar backend",
            ) from None
        return OutlinesCompiled(index, self.vocab_size, self.eos_token_ids, relaxed)

    def close(self) -> None:
        """Stops the worker processes that build Indexes."""
        self._builder.close()

    def _job_for(self, params: StructuredOutputParams) -> tuple[Job, tuple[RelaxedKeyword, ...]]:
        """What the worker builds (outlines-core's own regex for a schema is made there too:
        for some schemas it is gigabytes), and the keywords relaxed."""
        text = cast(str, params.value)  # a string for every kind but choice
        if params.compact:
            raise InvalidArgument(
                "structured.disable_any_whitespace",
                "the outlines backend cannot leave out JSON's whitespace; use the xgrammar backend",
            )
        try:
            if params.kind in ("json_schema", "json_object"):
                schema = parse_schema(text) if params.kind == "json_schema" else {"type": "object"}
                prepared = prepare_schema(schema, OUTLINES_RULES, params.relaxed)
                return SchemaJob(prepared.text, prepared.splices), prepared.relaxed
            return self._plain_regex(params, text), ()
        except InvalidArgument:
            raise
        except (RegexProblem, ValueError, TypeError) as e:  # outlines-core's own message
            raise InvalidArgument(params.field, str(e)) from None

    def _plain_regex(self, params: StructuredOutputParams, text: str) -> str:
        if params.kind == "regex":
            return strip_anchors(text)
        if params.kind == "choice":
            if any(END_MARK.decode() in choice for choice in params.value):
                raise InvalidArgument(
                    params.field,
                    "the outlines backend cannot write NUL (U+0000); use the xgrammar backend",
                )
            return "|".join(_escape(choice) for choice in params.value)
        what = "structural tags" if params.kind == "structural_tag" else "EBNF grammars"
        raise InvalidArgument(
            params.field,
            f"the outlines backend does not support {what} (outlines-core has no "
            "context-free engine); use the xgrammar backend",
        )


def _escape(literal: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in literal)


def _vocabulary(
    tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_token_ids: Sequence[int]
) -> Vocabulary:
    """Token bytes -> ids, without special tokens (stop tokens are handled by the matcher),
    and with the end mark (outlines_worker.py) as a token of its own, held by no other."""
    by_bytes: dict[bytes, list[int]] = {END_MARK: [END_MARK_TOKEN_ID]}
    for i, data in enumerate(token_bytes(tokenizer, vocab_size)):
        if data and i not in eos_token_ids and END_MARK not in data:
            by_bytes.setdefault(data, []).append(i)
    return Vocabulary(eos_token_ids[0], by_bytes)


class OutlinesCompiled(CompiledGrammar):
    def __init__(
        self,
        index: Index,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        relaxed: tuple[RelaxedKeyword, ...] = (),
    ) -> None:
        self.relaxed = relaxed
        self._index = index
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids

    def matcher(self) -> GrammarMatcher:
        return OutlinesMatcher(self._index, self._vocab_size, self._eos_token_ids)


class OutlinesMatcher(GrammarMatcher):
    """A Guide plus what it lacks: the end of the output, stop tokens, and rollback of them.

    The Index is the regex's followed by the end mark (outlines_worker.py), so the Guide
    never reaches one of its final states: the output may end where the end mark's token
    leads to one. Stop tokens are allowed there, and the Guide never sees them.
    """

    def __init__(self, index: Index, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._index = index
        self._guide = Guide(index, max_rollback=MAX_ROLLBACK_TOKENS)
        self._width = bitmask_width(vocab_size)
        self._eos_token_ids = eos_token_ids
        self._terminated = False
        self._history: list[bool] = []  # per accepted token: True = the Guide advanced

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._eos_token_ids:
            if not self._can_end():
                return False
            self._terminated = True
            self._history.append(False)
            return True
        if not self._guide.accepts_tokens([token_id]):
            return False
        self._guide.advance(token_id, return_tokens=False)
        self._history.append(True)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if bitmask.shape[-1] != self._width or not bitmask.is_contiguous():
            raise ValueError(f"expected a contiguous bitmask of width {self._width}")
        words = bitmask[row]
        if self._terminated:
            words.zero_()
            allow_tokens(words, self._eos_token_ids)
            return
        self._guide.write_mask_into(words.data_ptr(), self._width, 4)
        if self._can_end():
            allow_tokens(words, self._eos_token_ids)

    def _can_end(self) -> bool:
        """Whether the output so far matches the whole regex. The mark's token being allowed
        is not enough: a regex that reads NUL itself (`a.*b`, after "a") lets it on too."""
        marked = self._index.get_next_state(self._guide.get_state(), END_MARK_TOKEN_ID)
        return marked is not None and self._index.is_final_state(marked)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._history) or num_tokens > MAX_ROLLBACK_TOKENS:
            raise ValueError(f"cannot roll back {num_tokens} tokens")
        undone = self._history[len(self._history) - num_tokens :]
        del self._history[len(self._history) - num_tokens :]
        if not all(undone):  # a stop token is always last
            self._terminated = False
        if sum(undone):
            self._guide.rollback_state(sum(undone))

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._guide.reset()
        self._history.clear()
        self._terminated = False
