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

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidArgument
from mmserve.processors.long_texts import Keep, LongText, find_long_text

TRUNCATE_MODES = ("none", "left", "right")  # none: too long is an error naming the input
# the part of a text far past the limit that stands for it: what truncation keeps
_KEEP: dict[str, Keep] = {"none": "head", "left": "tail", "right": "head"}
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
        texts = {i: prompt + x for i, x in enumerate(inputs) if isinstance(x, str)}
        rust = self._rust(truncate)
        too_long = self._shorten(texts, truncate)
        by_index = dict(zip(texts, _encode_batch(rust, list(texts.values()))))
        out = []
        for i, (item, name) in enumerate(zip(inputs, names, strict=True)):
            enc = by_index.get(i)
            if i in too_long:
                _require_truncation(truncate, name, too_long[i], self.max_len, at_least=True)
            elif enc is not None:
                out.append(self._checked(enc.ids, enc.type_ids, truncate, name))
            else:
                out.append(self._checked(_token_ids(item, name), None, truncate, name))
        return out

    def encode_pairs(
        self, pairs: Sequence[tuple[str, str]], truncate: str, fields: Sequence[str]
    ) -> list[EncodedInput]:
        """Each (first, second) pair tokenised together, as a cross-encoder reads it;
        truncation takes tokens from the longer text first (transformers' longest_first).
        Pairs are tokenised untruncated and cut here: the Rust tokenizer's own pair
        truncation keeps every pair of overflowing pieces (two 120 KB texts took 18 GB)."""
        _check_mode(truncate)
        shortened = [self._pair(a, b, truncate) for a, b in pairs]
        kept = [pair for pair in shortened if not isinstance(pair, int)]
        encodings = iter(_encode_batch(self._rust("none"), kept) if kept else [])
        out = []
        for pair, field in zip(shortened, fields, strict=True):
            if isinstance(pair, int):  # far past the limit under none: refused in turn
                _require_truncation(truncate, field, pair, self.max_len, at_least=True)
            enc = next(encodings)
            ids, type_ids = enc.ids, enc.type_ids
            if truncate != "none" and len(ids) > self.max_len:
                ids, type_ids = _truncate_pair(enc, self._pair_room(), truncate)
            out.append(self._checked(ids, type_ids, truncate, field))
        return out

    def encode_yes_no(
        self, query: str, document: str, truncate: str, query_field: str, document_field: str
    ) -> EncodedInput:
        """The yes/no question about (query, document) in the chat template; truncation
        shortens the document only, so the question and the answer cue always survive."""
        _check_mode(truncate)
        before, middle, after = self._question_parts()
        plain = self._rust("none")
        query, document = query.strip(), document.strip()
        if find_long_text(self._ids(False), query, self.max_len) is not None:
            raise _long_question(query_field, self.max_len)
        long = self._long(document, truncate, special_tokens=False)
        if long is not None:  # its tail (left) or head (right) holds every token kept
            _require_truncation(truncate, document_field, long.at_least, self.max_len, True)
            document = long.part
        q = plain.encode(query, add_special_tokens=False).ids
        d = plain.encode(document, add_special_tokens=False).ids
        room = self.max_len - len(before) - len(middle) - len(after) - len(q)
        if room < 0:
            raise _long_question(query_field, self.max_len)
        if len(d) > room:
            _require_truncation(
                truncate, document_field, len(d) + self.max_len - room, self.max_len
            )
            d = d[:room] if truncate == "right" else d[len(d) - room :]
        return EncodedInput(before + q + middle + d + after, None)

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest id this encoder's texts can hold: of the vocabulary with its added
        tokens, and of the special tokens the post-processor puts around a text or a pair
        (its templates are fixed, so encoding empty ones shows them all)."""
        plain = self._rust("none")
        ids = [*plain.get_vocab(with_added_tokens=True).values(), *plain.encode("").ids]
        with contextlib.suppress(Exception):  # no pair template: pairs are never encoded
            ids += plain.encode("", "").ids
        return max(ids, default=-1)

    def _shorten(self, texts: dict[int, str], truncate: str) -> dict[int, int]:
        """Texts found far past the limit from a part of them: under truncation replaced in
        `texts` by that part (its truncated tokens are the whole text's); under none taken
        out and returned, index -> the tokens each has at least (refused in turn)."""
        too_long = {}
        for i, text in texts.items():
            long = self._long(text, truncate)
            if long is not None and truncate == "none":
                too_long[i] = long.at_least
            elif long is not None:
                texts[i] = long.part
        for i in too_long:
            del texts[i]
        return too_long

    def _pair(self, a: str, b: str, truncate: str) -> tuple[str, str] | int:
        """The pair to tokenise, with a text far past the limit replaced by the part of it
        that holds its kept tokens; under none, the tokens a pair found so has at least.
        longest_first truncation takes from the longer text first, so the part must also be
        the longer (with both texts far past the limit, which is longer is only known from
        all their tokens: needed for an odd room only)."""
        long_a, long_b = self._long(a, truncate), self._long(b, truncate)
        if truncate == "none":
            bounds = [long.at_least for long in (long_a, long_b) if long is not None]
            return max(bounds) if bounds else (a, b)
        if long_a is not None and long_b is not None:
            # each keeps half the room; an odd token goes to the longer: known from all tokens
            return (long_a.part, long_b.part) if self._pair_room() % 2 == 0 else (a, b)
        if long_a is not None:
            return self._longer_part(a, b, truncate), b
        if long_b is not None:
            return a, self._longer_part(b, a, truncate)
        return a, b

    def _pair_room(self) -> int:
        """The tokens a pair's two texts may have together: the limit less special tokens."""
        return self.max_len - int(self._rust("none").num_special_tokens_to_add(is_pair=True))

    def _longer_part(self, text: str, other: str, truncate: str) -> str:
        """The part of text (far past the limit) that stands for it in a pair with `other`:
        with more tokens than `other`, as the whole text has."""
        limit = max(self.max_len, len(self._ids(True)(other)))
        long = self._long(text, truncate, limit=limit)
        return text if long is None else long.part

    def _long(
        self, text: str, truncate: str, special_tokens: bool = True, limit: int | None = None
    ) -> LongText | None:
        """The text found far past the limit (default max_len) from a part of it: under
        truncation, a part holding exactly the tokens truncation keeps."""
        limit = self.max_len if limit is None else limit
        ids, keep = self._ids(special_tokens), _KEEP[truncate]
        return find_long_text(ids, text, limit, keep, exact=truncate != "none")

    def _ids(self, special_tokens: bool) -> Callable[[str], list[int]]:
        """A text's token ids (with the special tokens added around it, or not)."""
        plain = self._rust("none")
        return lambda text: list(_encode_batch(plain, [text], special_tokens)[0].ids)

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
        _check_mode(truncate)
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


def _encode_batch(rust: Any, inputs: list[Any], special_tokens: bool = True) -> list[Any]:
    """The Rust tokenizer's encodings of inputs (texts or pairs), without character offsets
    where the tokenizers release can skip them (encode_batch_fast: about a quarter faster)."""
    fast = getattr(rust, "encode_batch_fast", None)
    encode = fast if fast is not None else rust.encode_batch
    return encode(inputs, add_special_tokens=special_tokens)  # type: ignore[no-any-return]


def _truncate_pair(encoding: Any, room: int, truncate: str) -> tuple[list[int], list[int]]:
    """The ids and segment ids of an untruncated pair encoding with its texts cut to `room`
    tokens (special tokens kept), as tokenizers' longest_first truncation cuts a pair."""
    sequence = encoding.sequence_ids  # per token: 0 (first text), 1 (second) or None
    lengths = (sequence.count(0), sequence.count(1))
    keep = _longest_first(lengths[0], lengths[1], room)
    # each text keeps its first keep[s] tokens (right) or its last (left)
    first = (0, 0) if truncate == "right" else (lengths[0] - keep[0], lengths[1] - keep[1])
    seen = [0, 0]
    ids, type_ids = [], []
    for token, type_id, s in zip(encoding.ids, encoding.type_ids, sequence, strict=True):
        if s is not None:
            seen[s] += 1
            if not first[s] < seen[s] <= first[s] + keep[s]:
                continue
        ids.append(token)
        type_ids.append(type_id)
    return ids, type_ids


def _longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """The tokens two texts of n1 and n2 tokens keep in `room`, as tokenizers' longest_first
    truncation keeps them: the longer loses tokens first; when both must lose some, each
    keeps half the room, the odd token going to the longer (the second, on a tie)."""
    if n1 + n2 <= room:
        return n1, n2
    short = min(n1, n2)
    keep_long = short if short > room else max(short, room - short)
    if short + keep_long > room:
        short, keep_long = room // 2, room // 2 + room % 2
    return (short, keep_long) if n1 <= n2 else (keep_long, short)


def _check_mode(truncate: str) -> None:
    if truncate not in TRUNCATE_MODES:
        raise InvalidArgument("truncate", f"{truncate!r} is not one of {TRUNCATE_MODES}")


def _token_ids(item: object, field: str) -> list[int]:
    ids = list(item) if isinstance(item, Sequence) else [None]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidArgument(field, "must be a string or a list of token ids")
    return [int(t) for t in ids]  # type: ignore[arg-type]


def _require_truncation(
    truncate: str, field: str, length: int, limit: int, at_least: bool = False
) -> None:
    """InvalidArgument on field under truncate none; at_least: length is a lower bound."""
    if truncate == "none":
        count = f"at least {length}" if at_least else str(length)
        raise InvalidArgument(
            field, f"{count} tokens exceed the limit of {limit}; set truncate to LEFT or RIGHT"
        )


def _long_question(field: str, limit: int) -> InvalidArgument:
    return InvalidArgument(field, f"too long: the question exceeds the limit {limit}")
