"""Pooling inputs -> token ids, truncated (or refused) at the edge.

Texts are tokenised as given, surrounding whitespace included (as sentence-transformers 6,
its CrossEncoder, transformers, vLLM and TEI read them: a byte-level BPE or SentencePiece
tokenizer spells a trailing newline as a token), with the model's own tokenizer, special
tokens included; text pairs (cross-encoders) are tokenised together, which yields the segment
ids BERT needs. Token-id inputs are taken as they are (the caller chose the special tokens)
and only truncated.

transformers' tokenizers change truncation settings on their shared Rust tokenizer at each
call, which races between threads; this encoder instead owns private copies of the Rust
tokenizer, each with fixed settings (no truncation, left, right), never changed after setup.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidArgument

TRUNCATE_MODES = ("none", "left", "right")  # none: too long is an error naming the input
# yes-token scoring asks the model this, as a user turn rendered with its chat template
YES_NO_QUESTION = (
    'Judge whether the Document meets the requirements based on the Query. Answer only "yes" '
    'or "no".\nQuery: {query}\nDocument: {document}'
)
_QUERY, _DOCUMENT = "\x00QUERY\x00", "\x00DOCUMENT\x00"  # placeholders no user text contains

TextOrIds = str | Sequence[int]


@dataclass(frozen=True)
class EncodedInput:
    """One pooling request's tokens."""

    token_ids: list[int]
    token_type_ids: list[int] | None  # segment ids, for models that use them; else None
    mm_inputs: tuple[Any, ...] = ()  # an image input: its MMInput (token_ids: one placeholder)


class InputEncoder:
    """Tokenises and truncates pooling inputs for one model. Thread-safe."""

    def __init__(self, tokenizer: Any, max_len: int, use_token_types: bool) -> None:
        self.tokenizer = tokenizer  # transformers tokenizer (chat template, vocabulary)
        self.max_len = max_len  # token limit of one pooling input
        self.use_token_types = use_token_types  # the model reads segment ids (BERT pairs)
        self._copies: dict[str, Any] = {}  # truncate mode -> private Rust tokenizer
        self._lock = threading.Lock()
        self._yes_no_parts: tuple[list[int], list[int], list[int]] | None = None

    def encode(
        self,
        inputs: Sequence[TextOrIds],
        truncate: str,
        field: str | Sequence[str],
        prompt: str = "",
    ) -> list[EncodedInput]:
        """One encoding per input, in order. field names the inputs in errors: a request
        field ("inputs" -> "inputs[3]"), or one name per input. prompt goes before each text
        (not token ids), as sentence-transformers puts it: prompt + text."""
        names = [f"{field}[{i}]" for i in range(len(inputs))] if isinstance(field, str) else field
        texts = [(i, prompt + x) for i, x in enumerate(inputs) if isinstance(x, str)]
        rust = self._rust(truncate)
        by_index = dict(zip((i for i, _ in texts), _encode_batch(rust, [t for _, t in texts])))
        out = []
        for i, (item, name) in enumerate(zip(inputs, names, strict=True)):
            enc = by_index.get(i)
            if enc is not None:
                out.append(self._checked(enc.ids, enc.type_ids, truncate, name))
            else:
                out.append(self._checked(_token_ids(item, name), None, truncate, name))
        return out

    def encode_pairs(
        self, pairs: Sequence[tuple[str, str]], truncate: str, fields: Sequence[str]
    ) -> list[EncodedInput]:
        """Each (first, second) pair tokenised together, as a cross-encoder reads it;
        truncation takes tokens from the longer text first (transformers' longest_first)."""
        encodings = _encode_batch(self._rust(truncate), list(pairs)) if pairs else []
        return [
            self._checked(enc.ids, enc.type_ids, truncate, field)
            for enc, field in zip(encodings, fields, strict=True)
        ]

    def encode_yes_no(
        self, query: str, document: str, truncate: str, query_field: str, document_field: str
    ) -> EncodedInput:
        """The yes/no question about (query, document) in the chat template; truncation
        shortens the document only, so the question and the answer cue always survive."""
        before, middle, after = self._question_parts()
        plain = self._rust("none")
        q = plain.encode(query.strip(), add_special_tokens=False).ids
        d = plain.encode(document.strip(), add_special_tokens=False).ids
        room = self.max_len - len(before) - len(middle) - len(after) - len(q)
        if room < 0:
            raise InvalidArgument(
                query_field, f"too long: the question exceeds the limit {self.max_len}"
            )
        if len(d) > room:
            _require_truncation(
                truncate, document_field, len(d) + self.max_len - room, self.max_len
            )
            d = d[:room] if truncate == "right" else d[len(d) - room :]
        return EncodedInput(before + q + middle + d + after, None)

    def _checked(
        self, ids: list[int], type_ids: list[int] | None, truncate: str, field: str
    ) -> EncodedInput:
        if not ids:
            raise InvalidArgument(field, "has no tokens")
        if len(ids) > self.max_len:  # token-id inputs, or texts under NONE (not truncated)
            _require_truncation(truncate, field, len(ids), self.max_len)
            keep = slice(None, self.max_len) if truncate == "right" else slice(-self.max_len, None)
            ids = ids[keep]
            type_ids = type_ids[keep] if type_ids is not None else None
        # all-zero segment ids equal no segment ids: send none, the batch needs no type tensor
        if not self.use_token_types or type_ids is None or not any(type_ids):
            return EncodedInput(list(ids), None)
        return EncodedInput(list(ids), list(type_ids))

    def _rust(self, truncate: str) -> Any:
        """The private Rust tokenizer for a truncate mode, made on first use."""
        if truncate not in TRUNCATE_MODES:
            raise InvalidArgument("truncate", f"{truncate!r} is not one of {TRUNCATE_MODES}")
        with self._lock:
            if truncate not in self._copies:
                self._copies[truncate] = self._make_copy(truncate)
            return self._copies[truncate]

    def _make_copy(self, truncate: str) -> Any:
        from tokenizers import Tokenizer

        rust = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
        rust.no_padding()
        if truncate == "none":
            rust.no_truncation()
        else:
            rust.enable_truncation(self.max_len, strategy="longest_first", direction=truncate)
        return rust

    def _question_parts(self) -> tuple[list[int], list[int], list[int]]:
        """Token ids of the rendered question around the query and the document."""
        if self._yes_no_parts is None:
            from mmserve.processors.chat_template import render_chat

            content = YES_NO_QUESTION.format(query=_QUERY, document=_DOCUMENT)
            text = render_chat(self.tokenizer, [{"role": "user", "content": content}])
            before, rest = text.split(_QUERY)
            middle, after = rest.split(_DOCUMENT)
            plain = self._rust("none")
            ids = [plain.encode(part, add_special_tokens=False).ids for part in (before, middle, after)]
            self._yes_no_parts = (ids[0], ids[1], ids[2])
        return self._yes_no_parts


def _encode_batch(rust: Any, inputs: list[Any]) -> list[Any]:
    """The Rust tokenizer's encodings of inputs (texts or pairs), without character offsets
    where the tokenizers release can skip them (encode_batch_fast: about a quarter faster)."""
    fast = getattr(rust, "encode_batch_fast", None)
    return fast(inputs) if fast is not None else rust.encode_batch(inputs)  # type: ignore[no-any-return]


def _token_ids(item: object, field: str) -> list[int]:
    ids = list(item) if isinstance(item, Sequence) else [None]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidArgument(field, "must be a string or a list of token ids")
    return [int(t) for t in ids]  # type: ignore[arg-type]


def _require_truncation(truncate: str, field: str, length: int, limit: int) -> None:
    if truncate == "none":
        raise InvalidArgument(
            field, f"{length} tokens exceed the limit of {limit}; set truncate to LEFT or RIGHT"
        )
