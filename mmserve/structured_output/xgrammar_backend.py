"""The xgrammar backend (default): JSON schema, JSON object, regex, choice, EBNF (or Lark) and
structural tags."""

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
from .lark_grammar import LarkProblem, is_lark, lark_to_ebnf
from .params import StructuredOutputParams
from .prepare import prepare_schema
from .regex_check import RegexProblem, strip_anchors
from .schema_check import parse_schema
from .schema_tree import RelaxedKeyword
from .star_fold import fold_star_terminals
from .structural_tag import prepare_structural_tag
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

# A UTF-16 surrogate's UTF-8 form (U+D800-U+DFFF: ED A0-BF xx), which is not UTF-8 at all:
# xgrammar 0.2.9 lets it into JSON strings and character classes (it refuses overlong forms),
# and a client's decoder reads it as U+FFFD, so a string's maxLength or pattern no longer
# holds for the text received. _Utf8Guard keeps it out.
_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")

# xgrammar prefixes its errors with "[time] /path/file.cc:line: ", some (a structural tag's
# token not in the vocabulary) with its failed check's C++ condition too.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class XGrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        info = _tokenizer_info(tokenizer, vocab_size, list(eos_token_ids))
        self._utf8 = _Utf8Guard(info.decoded_vocab, vocab_size)
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
            text = cast(str, params.value)  # validated: a string for every kind but choice
            if params.kind == "json_schema":
                prepared = prepare_schema(parse_schema(text), XGRAMMAR_RULES, params.relaxed)
                compiled, relaxed = self._json_schema(prepared.text, params.compact), prepared.relaxed
            elif params.kind == "structural_tag":
                compiled, relaxed = self._structural_tag(text, params.relaxed)
            else:
                compiled = self._compile_kind[params.kind](params)
        except InvalidArgument:
            raise
        except (RuntimeError, ValueError) as e:  # the compiler's own message, cleaned up
            raise InvalidArgument(params.field, _clean(str(e))) from None
        return XGrammarCompiled(compiled, self.vocab_size, self.eos_token_ids, relaxed, self._utf8)

    def _json_schema(self, text: str, compact: bool) -> xgr.CompiledGrammar:
        """`text`: a schema as prepare_schema leaves it (everything in it is enforced).
        compact: no whitespace but xgrammar's separators, ", " and ": "."""
        grammar = xgr.Grammar.from_json_schema(
            text, any_whitespace=not compact, max_whitespace_cnt=None if compact else JSON_MAX_WHITESPACE
        )
        return self._compile_json_strings(grammar)

    def _compile_json_strings(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        """grammar compiled, its JSON strings' characters JSON's (_LOOSE_STRING_CHAR)."""
        ebnf = str(grammar)
        if _LOOSE_STRING_CHAR not in ebnf:
            return self._compiler.compile_grammar(grammar)
        try:
            return self._compiler.compile_grammar(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
        except (RuntimeError, ValueError):  # (never seen: a printed grammar that does not parse)
            logger.warning("a JSON grammar's text did not compile patched; compiling it as built")
            return self._compiler.compile_grammar(grammar)

    def _structural_tag(
        self, text: str, relaxed: bool
    ) -> tuple[xgr.CompiledGrammar, tuple[RelaxedKeyword, ...]]:
        """vLLM's structural_tag (structural_tag.py: its schemas prepared as json_schema's)."""
        prepared = prepare_structural_tag(text, XGRAMMAR_RULES, relaxed, JSON_MAX_WHITESPACE)
        if prepared.names_tokens:  # resolved against the compiler's vocabulary, so compiled
            # by it as it is (a length-bounded string's characters are xgrammar's there)
            return self._compiler.compile_structural_tag(prepared.text), prepared.relaxed
        grammar = xgr.Grammar.from_structural_tag(prepared.text)
        return self._compile_json_strings(grammar), prepared.relaxed

    def _json_object(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        return self._json_schema('{"type": "object"}', params.compact)

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
        text = cast(str, params.value)
        if is_lark(text):  # vLLM takes Lark's syntax too: rewritten as EBNF (lark_grammar.py)
            try:
                text = lark_to_ebnf(text)
            except LarkProblem as e:
                raise InvalidArgument(params.field, str(e)) from None
        grammar = xgr.Grammar.from_ebnf(text, root_rule_name="root")
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


class _Utf8Guard:
    """The tokens that would write a surrogate's bytes (_SURROGATE), from xgrammar's own view
    of each token's bytes: those holding the whole pair (never allowed), and those starting
    with A0-BF (not allowed after a token that ends with the lead ED). Byte-level vocabularies
    learnt from UTF-8 text have none of the first kind; every one has the second (its byte
    tokens)."""

    def __init__(self, decoded: Sequence[bytes], vocab_size: int) -> None:
        width = bitmask_width(vocab_size)
        leads = [(i, b) for i, b in enumerate(decoded) if b"\xed" in b]  # (a few hundred of 128k)
        self.never = frozenset(i for i, b in leads if _SURROGATE.search(b))
        self.after_lead = self.never | {i for i, b in enumerate(decoded) if b"\xa0" <= b[:1] <= b"\xbf"}
        self.ends_lead = frozenset(i for i, b in leads if b.endswith(b"\xed"))
        # bitmask words to AND a row with: every token allowed but those named
        self.keep = _all_but(self.never, width)
        self.keep_after_lead = _all_but(self.after_lead, width)

    def forbids(self, token_id: int, after_lead: bool) -> bool:
        return token_id in (self.after_lead if after_lead else self.never)

    def narrow(self, bitmask: torch.Tensor, rows: Sequence[int], after_lead: Sequence[bool]) -> None:
        """Takes the forbidden tokens out of the filled rows (after_lead[i]: rows[i]'s output
        ends with a lone ED)."""
        lead_rows = [r for r, lead in zip(rows, after_lead, strict=True) if lead]
        other_rows = [r for r, lead in zip(rows, after_lead, strict=True) if not lead]
        if lead_rows:
            bitmask[lead_rows] &= self.keep_after_lead
        if other_rows and self.never:
            bitmask[other_rows] &= self.keep


def _all_but(token_ids: frozenset[int], width: int) -> torch.Tensor:
    words = torch.zeros(width, dtype=torch.int32)
    allow_tokens(words, token_ids)
    return ~words


class XGrammarCompiled(CompiledGrammar):
    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        relaxed: tuple[RelaxedKeyword, ...],
        utf8: _Utf8Guard,
    ) -> None:
        self.relaxed = relaxed
        self._compiled = compiled
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._utf8 = utf8

    def matcher(self) -> GrammarMatcher:
        return XGrammarMatcher(self._compiled, self._vocab_size, self._stop_token_ids, self._utf8)


@functools.lru_cache(maxsize=8)
def _batch_matcher(threads: int) -> xgr.BatchGrammarMatcher:
    """xgrammar's batch filler (and its thread pool), made once per thread count."""
    return xgr.BatchGrammarMatcher(max_threads=threads)


class XGrammarMatcher(GrammarMatcher):
    def __init__(
        self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_token_ids: Sequence[int], utf8: _Utf8Guard
    ) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)  # keeps unlimited rollback history
        self._width = bitmask_width(vocab_size)
        self._stop_token_ids = stop_token_ids
        self._utf8 = utf8
        self._accepted = 0  # tokens accepted since the start: the most rollback can undo
        self._leads: set[int] = set()  # the counts at which an accepted token ended with ED

    @property
    def _after_lead(self) -> bool:
        return self._accepted in self._leads

    def _accepted_one(self, token_id: int) -> None:
        self._accepted += 1
        if token_id in self._utf8.ends_lead:
            self._leads.add(self._accepted)

    def accept_token(self, token_id: int) -> bool:
        if self._utf8.forbids(token_id, self._after_lead) or not self._matcher.accept_token(token_id):
            return False
        self._accepted_one(token_id)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._filled_as_terminated(bitmask, row):
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._utf8.narrow(bitmask, [row], [self._after_lead])

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
            for guard in {id(m._utf8): m._utf8 for m, _ in live}.values():  # (one per backend)
                mine = [(m, r) for m, r in live if m._utf8 is guard]
                if guard.never or any(m._leads for m, _ in mine):  # (else nothing to take out)
                    guard.narrow(bitmask, [r for _, r in mine], [m._after_lead for m, _ in mine])

    @classmethod
    def accept_tokens(cls, matchers: Sequence[Self], tokens: Sequence[int]) -> list[bool]:
        if any(m._leads or m._utf8.never for m in matchers):  # (rare: else nothing is forbidden)
            allowed = [i for i, (m, t) in enumerate(zip(matchers, tokens, strict=True))
                       if not m._utf8.forbids(t, m._after_lead)]  # fmt: skip
        else:
            allowed = list(range(len(matchers)))
        accepted = [False] * len(matchers)
        if allowed:
            results = xgr.BatchGrammarMatcher.batch_accept_token(
                [matchers[i]._matcher for i in allowed], [tokens[i] for i in allowed]
            )
            for i, ok in zip(allowed, results, strict=True):
                if ok:
                    matchers[i]._accepted_one(tokens[i])
                accepted[i] = bool(ok)
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
        if self._leads:
            self._leads = {n for n in self._leads if n <= self._accepted}

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def jump_forward(self) -> str:
        if self._matcher.is_terminated():
            return ""
        return str(self._matcher.find_jump_forward_string())

    def reset(self) -> None:
        self._matcher.reset()
        self._accepted = 0
        self._leads.clear()


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
