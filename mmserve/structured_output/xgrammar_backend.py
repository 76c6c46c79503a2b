"""The xgrammar backend (default): JSON schema, JSON object, regex, choice and EBNF."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Self, cast

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from mmserve.errors import InvalidArgument

from .backend import (
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
    allow_tokens,
    bitmask_width,
)
from .keywords import XGRAMMAR_RULES
from .params import StructuredOutputParams
from .prepare import prepare_schema
from .regex_check import RegexProblem, strip_anchors
from .schema_check import parse_schema
from .schema_tree import RelaxedKeyword
from .star_fold import fold_star_terminals
from .vocab import special_token_ids

logger = logging.getLogger(__name__)

# Whitespace the grammar allows between JSON tokens, per gap: enough for pretty-printed
# output, while a model that loops on newlines cannot run on forever inside a schema.
JSON_MAX_WHITESPACE = 32

# xgrammar 0.2.9 builds the characters of a length-limited string (minLength / maxLength,
# also on property names) from this class, which lets raw control characters other than
# CR/LF into the JSON text: invalid JSON. The EBNF is patched to JSON's class (escapes stay
# excluded there, which only narrows). tests/structured_output checks the patched result.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"

# xgrammar prefixes its errors with "[time] /path/file.cc:line: ".
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class XGrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        info = _tokenizer_info(tokenizer, vocab_size, list(eos_token_ids))
        # Our GrammarCache bounds memory; xgrammar's own cache would keep a second copy.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compile_kind: dict[str, Callable[[StructuredOutputParams], xgr.CompiledGrammar]] = {
            "json_object": self._json_object,
            "regex": self._regex,
            "choice": self._choice,
            "grammar": self._grammar,
        }

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        params.validate()
        relaxed: tuple[RelaxedKeyword, ...] = ()
        try:
            if params.kind == "json_schema":
                text = cast(str, params.value)  # validated: a string for every kind but choice
                prepared = prepare_schema(parse_schema(text), XGRAMMAR_RULES, params.relaxed)
                compiled, relaxed = self._json_schema(prepared.text), prepared.relaxed
            else:
                compiled = self._compile_kind[params.kind](params)
        except InvalidArgument:
            raise
        except (RuntimeError, ValueError) as e:  # the compiler's own message, cleaned up
            raise InvalidArgument(params.field, _clean(str(e))) from None
        return XGrammarCompiled(compiled, self.vocab_size, self.eos_token_ids, relaxed)

    def _json_schema(self, text: str) -> xgr.CompiledGrammar:
        """`text`: a schema as prepare_schema leaves it (everything in it is enforced)."""
        grammar = xgr.Grammar.from_json_schema(
            text, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
        )
        ebnf = str(grammar)
        if _LOOSE_STRING_CHAR not in ebnf:
            return self._compiler.compile_grammar(grammar)
        return self._compiler.compile_grammar(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))

    def _json_object(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        return self._compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
        )

    def _regex(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        try:
            pattern = strip_anchors(cast(str, params.value))
        except RegexProblem as e:
            raise InvalidArgument(params.field, str(e)) from None
        return self._compiler.compile_regex(pattern)

    def _choice(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        # EBNF string literals take JSON-style escapes, so json.dumps quotes any choice.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.value)
        return self._compiler.compile_grammar(f"root ::= {alternatives}")

    def _grammar(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        # (normalised, then each repetition a terminal follows folded into it: star_fold.py,
        # the same language with masks hundreds of times cheaper to fill inside it)
        grammar = xgr.Grammar.from_ebnf(cast(str, params.value), root_rule_name="root")
        folded = _folded(grammar)
        if folded is not None:
            try:
                return self._compiler.compile_grammar(folded)
            except (RuntimeError, ValueError):  # (never seen: a fold that xgrammar refused)
                logger.warning("a folded EBNF grammar did not compile; compiling it unfolded")
        return self._compiler.compile_grammar(grammar)


def _folded(grammar: xgr.Grammar) -> str | None:
    """grammar's normalised text with its repetitions folded (star_fold), or None: nothing to
    fold, or a text that does not parse back to itself (the fold rests on the text being the
    grammar; every grammar tried did)."""
    text = str(grammar)
    folded = fold_star_terminals(text)
    if folded == text:
        return None
    try:
        same = str(xgr.Grammar.from_ebnf(text, root_rule_name="root")) == text
    except (RuntimeError, ValueError):
        same = False
    return folded if same else None


class XGrammarCompiled(CompiledGrammar):
    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        relaxed: tuple[RelaxedKeyword, ...] = (),
    ) -> None:
        self.relaxed = relaxed
        self._compiled = compiled
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids

    def matcher(self) -> GrammarMatcher:
        return XGrammarMatcher(self._compiled, self._vocab_size, self._stop_token_ids)


@functools.lru_cache(maxsize=8)
def _batch_matcher(threads: int) -> xgr.BatchGrammarMatcher:
    """xgrammar's batch filler (and its thread pool), made once per thread count."""
    return xgr.BatchGrammarMatcher(max_threads=threads)


class XGrammarMatcher(GrammarMatcher):
    def __init__(
        self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)  # keeps unlimited rollback history
        self._width = bitmask_width(vocab_size)
        self._stop_token_ids = stop_token_ids
        self._accepted = 0  # tokens accepted since the start: the most rollback can undo

    def accept_token(self, token_id: int) -> bool:
        accepted = bool(self._matcher.accept_token(token_id))
        self._accepted += accepted
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._filled_as_terminated(bitmask, row):
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @classmethod
    def fill_bitmasks(
        cls, matchers: Sequence[Self], bitmask: torch.Tensor, rows: Sequence[int], threads: int
    ) -> None:
        # One call: xgrammar splits the matchers over its threads, without holding the GIL.
        live = [(m, r) for m, r in zip(matchers, rows, strict=True)
                if not m._filled_as_terminated(bitmask, r)]  # fmt: skip
        if live:  # xgrammar logs a warning for more threads than CPUs
            threads = min(threads, len(live), os.cpu_count() or 1)
            _batch_matcher(threads).batch_fill_next_token_bitmask(
                [m._matcher for m, _ in live], bitmask, [r for _, r in live]
            )

    @classmethod
    def accept_tokens(cls, matchers: Sequence[Self], tokens: Sequence[int]) -> list[bool]:
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(
            [m._matcher for m in matchers], list(tokens)
        )
        for matcher, ok in zip(matchers, accepted, strict=True):
            matcher._accepted += ok
        return accepted

    def _filled_as_terminated(self, bitmask: torch.Tensor, row: int) -> bool:
        """Check the width; once terminated (xgrammar refuses to fill then) allow only the
        stop tokens in bitmask[row] and return True."""
        if bitmask.shape[-1] != self._width:  # xgrammar would write a wrongly strided mask
            raise ValueError(f"bitmask width {bitmask.shape[-1]}, expected {self._width}")
        if not self._matcher.is_terminated():
            return False
        bitmask[row].zero_()
        allow_tokens(bitmask[row], self._stop_token_ids)
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self._accepted} tokens")
        self._matcher.rollback(num_tokens)
        self._accepted -= num_tokens

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def jump_forward(self) -> str:
        if self._matcher.is_terminated():
            return ""
        return str(self._matcher.find_jump_forward_string())

    def reset(self) -> None:
        self._matcher.reset()
        self._accepted = 0


def _tokenizer_info(
    tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with special tokens disabled.

    xgrammar detects the vocabulary's encoding well but treats control tokens such as
    <|im_start|> as ordinary text (they would be allowed inside JSON strings); an empty
    token is what it treats as never-allowed, so the specials are emptied, stop tokens kept.
    """
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids
    )
    vocab = [""] * vocab_size  # ids past the tokenizer stay empty: never allowed
    special = special_token_ids(tokenizer) - set(eos_token_ids)
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special:
            vocab[i] = token
    return xgr.TokenizerInfo(
        vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=eos_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


def _clean(message: str) -> str:
    lines = [_LOG_PREFIX.sub("", line).strip() for line in message.splitlines()]
    return " ".join(line for line in lines if line) or "the grammar compiler rejected it"
