"""Tokenising and truncating pooling inputs at the edge (MiniLM's WordPiece tokenizer)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from mmserve.errors import InvalidArgument
from mmserve.frontend import pooling_inputs
from mmserve.frontend.pooling_inputs import InputEncoder

LIMIT = 8
CLS, SEP = 101, 102
TEXT = "one two three four five six seven eight nine ten"  # 10 word pieces


@pytest.fixture(scope="module")
def tokenizer(minilm: Path) -> Any:
    from mmserve.processors.tokenizer import load_tokenizer

    return load_tokenizer(minilm)


@pytest.fixture(scope="module")
def encoder(tokenizer: Any) -> InputEncoder:
    return InputEncoder(tokenizer, LIMIT, use_token_types=True)


def test_truncation_keeps_the_special_tokens(encoder: InputEncoder, tokenizer: Any) -> None:
    words = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    right = encoder.encode([TEXT], "right", "inputs")[0]
    left = encoder.encode([TEXT], "left", "inputs")[0]
    assert right.token_ids == [CLS, *words[: LIMIT - 2], SEP]
    assert left.token_ids == [CLS, *words[-(LIMIT - 2) :], SEP]
    assert right.token_type_ids is None  # all zeros: nothing to send
    with pytest.raises(InvalidArgument, match=r"^inputs\[1\]: 12 tokens exceed the limit of 8"):
        encoder.encode(["short", TEXT], "none", "inputs")


def test_short_inputs_are_tokenised_as_given(encoder: InputEncoder, tokenizer: Any) -> None:
    (padded,) = encoder.encode(["  one two\n"], "none", "inputs")
    assert padded.token_ids == tokenizer("  one two\n")["input_ids"]
    (empty,) = encoder.encode([""], "none", "inputs")
    assert empty.token_ids == [CLS, SEP]


def test_token_id_inputs_are_taken_as_they_are(encoder: InputEncoder) -> None:
    ids = list(range(1000, 1012))
    assert encoder.encode([ids], "right", "inputs")[0].token_ids == ids[:LIMIT]
    assert encoder.encode([ids], "left", "inputs")[0].token_ids == ids[-LIMIT:]
    mixed = encoder.encode(["one", [CLS, 7, SEP]], "none", "inputs")
    assert mixed[1].token_ids == [CLS, 7, SEP]
    with pytest.raises(InvalidArgument, match=r"^inputs\[0\]: has no tokens"):
        encoder.encode([[]], "none", "inputs")
    with pytest.raises(InvalidArgument, match=r"^inputs\[0\]: must be a string or a list"):
        encoder.encode([[1.5]], "none", "inputs")  # type: ignore[list-item]


def test_pairs_truncate_like_transformers(encoder: InputEncoder, tokenizer: Any) -> None:
    pairs = [("one two", TEXT), (TEXT, "one"), ("one", "two")]
    ours = encoder.encode_pairs(pairs, "right", ["a", "b", "c"])
    for (first, second), got in zip(pairs, ours):
        expected = tokenizer(first, second, truncation=True, max_length=LIMIT)
        assert got.token_ids == expected["input_ids"]
        assert got.token_type_ids == expected["token_type_ids"]
    with pytest.raises(InvalidArgument, match=r"^a: 15 tokens exceed the limit of 8"):
        encoder.encode_pairs(pairs, "none", ["a", "b", "c"])


# -- texts far past the limit: only a part of them is tokenised ---------------------------

_rng = random.Random(0)
LONG = " ".join(_rng.choice(TEXT.split()) + _rng.choice(["", ",", "."]) for _ in range(60_000))


class _Counting:
    """A Rust tokenizer that records the characters it was given to tokenise, by the
    truncate mode it was made for."""

    def __init__(self, rust: Any, mode: str, seen: list[tuple[str, int]]) -> None:
        self.rust, self.mode, self.seen = rust, mode, seen

    def encode_batch_fast(self, inputs: list[Any], add_special_tokens: bool = True) -> Any:
        for x in inputs:
            self.seen.append((self.mode, len(x) if isinstance(x, str) else len(x[0]) + len(x[1])))
        return self.rust.encode_batch_fast(inputs, add_special_tokens=add_special_tokens)

    def num_special_tokens_to_add(self, is_pair: bool) -> int:
        return int(self.rust.num_special_tokens_to_add(is_pair))


def counted(tokenizer: Any, limit: int = LIMIT) -> tuple[InputEncoder, list[tuple[str, int]]]:
    """An encoder whose tokenizers record what they tokenise."""
    encoder, seen = InputEncoder(tokenizer, limit, use_token_types=True), []
    make = encoder._make_copy
    encoder._make_copy = lambda mode: _Counting(make(mode), mode, seen)  # type: ignore[method-assign]
    return encoder, seen


def chars(seen: list[tuple[str, int]]) -> int:
    return sum(n for _, n in seen)


def rust_truncating(tokenizer: Any, limit: int, truncate: str) -> Any:
    """The Rust tokenizer truncating as the encoder must (its padding turned off)."""
    from tokenizers import Tokenizer

    rust = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    rust.no_padding()
    rust.enable_truncation(limit, strategy="longest_first", direction=truncate)
    return rust


def test_a_text_far_past_the_limit_is_refused_from_a_head(tokenizer: Any) -> None:
    encoder, seen = counted(tokenizer)
    with pytest.raises(InvalidArgument, match=r"^inputs\[1\]: at least \d+ tokens exceed the limit of 8"):
        encoder.encode(["short", LONG], "none", "inputs")
    assert chars(seen) < len(LONG) // 10
    with pytest.raises(InvalidArgument, match=r"^inputs\[0\]: 12 tokens exceed"):  # in order
        encoder.encode([TEXT, LONG], "none", "inputs")
    with pytest.raises(InvalidArgument, match=r"^b: at least \d+ tokens exceed the limit of 8"):
        encoder.encode_pairs([("one", LONG)], "none", ["b"])
    assert chars(seen) < len(LONG) // 5


@pytest.mark.parametrize("truncate", ["right", "left"])
def test_truncating_a_long_text_tokenises_the_part_it_keeps(tokenizer: Any, truncate: str) -> None:
    encoder, seen = counted(tokenizer)
    (got,) = encoder.encode([LONG], truncate, "inputs")
    assert got.token_ids == rust_truncating(tokenizer, LIMIT, truncate).encode(LONG).ids
    assert chars(seen) < len(LONG) // 10


@pytest.mark.parametrize("truncate", ["right", "left"])
def test_pairs_truncate_as_the_rust_tokenizer(tokenizer: Any, truncate: str) -> None:
    """Pairs are cut by the encoder itself (longest_first), never by the Rust tokenizer,
    whose pair truncation keeps every pair of overflowing pieces: quadratic in memory."""
    words, rng = TEXT.split() + ["antidisestablishment"], random.Random(1)

    def text() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))

    pairs = [(text(), text()) for _ in range(200)]
    for limit in (4, 8, 9, 64):  # rooms for the texts of 1, 5 (odd), 6 (even) and 61
        encoder, seen = counted(tokenizer, limit)
        rust = rust_truncating(tokenizer, limit, truncate)
        got = encoder.encode_pairs(pairs, truncate, ["p"] * len(pairs))
        for (a, b), g in zip(pairs, got, strict=True):
            expected = rust.encode(a, b)
            assert g.token_ids == expected.ids
            assert g.token_type_ids == (expected.type_ids if any(expected.type_ids) else None)
        assert {mode for mode, _ in seen} == {"none"}


@pytest.mark.parametrize("truncate", ["right", "left"])
def test_a_long_text_in_a_pair_keeps_longest_first(
    tokenizer: Any, truncate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two texts past half the room, each keeps half, and the odd place goes to the
    longer: the part standing for a long text must have more tokens than the other text
    too (mid's 3,500 are more than LONG's first part holds)."""
    encoder, seen = counted(tokenizer, 256)
    mid = " ".join(TEXT.split()[i % 10] for i in range(3500))  # too short to try parts of
    long = LONG[:100_000]
    pairs = [("one two", LONG), (LONG, "one"), (mid, long), (long, mid)]
    got = encoder.encode_pairs(pairs, truncate, ["a", "b", "c", "d"])
    assert max(n for _, n in seen) < len(long) // 1.5  # neither long text tokenised whole
    monkeypatch.setattr(pooling_inputs, "find_long_text", lambda *args, **kwargs: None)
    whole = InputEncoder(tokenizer, 256, use_token_types=True)  # tokenises all of each text
    assert got == whole.encode_pairs(pairs, truncate, ["a", "b", "c", "d"])


@pytest.mark.parametrize("truncate", ["right", "left"])
@pytest.mark.parametrize("limit", [8, 9])
def test_two_long_texts_in_a_pair(tokenizer: Any, truncate: str, limit: int) -> None:
    """Each keeps half the room; an odd place goes to the longer text, which only all their
    tokens tell: with an odd room (5 of 8) both are tokenised whole, with an even one (6 of
    9) only their parts."""
    encoder, seen = counted(tokenizer, limit)
    a, b = LONG, LONG[: len(LONG) // 2]  # a is the longer
    (got,) = encoder.encode_pairs([(b, a)], truncate, ["p"])
    room = limit - 3  # [CLS] b [SEP] a [SEP]
    ids_a, ids_b = (tokenizer.encode(t, add_special_tokens=False) for t in (a, b))
    kept_b, kept_a = room // 2, room // 2 + room % 2
    if truncate == "right":
        assert got.token_ids == [CLS, *ids_b[:kept_b], SEP, *ids_a[:kept_a], SEP]
    else:
        assert got.token_ids == [CLS, *ids_b[-kept_b:], SEP, *ids_a[-kept_a:], SEP]
    if room % 2:
        assert chars(seen) >= len(a) + len(b)
    else:
        assert chars(seen) < len(a) // 5


def test_max_token_id_counts_the_post_processors_special_tokens() -> None:
    """A template's special token may carry an id its vocabulary lacks: the bound holds it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    rust = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "</s>": 2}, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B:1 <sep>:1", special_tokens=[("</s>", 7), ("<sep>", 9)]
    )
    encoder = InputEncoder(PreTrainedTokenizerFast(tokenizer_object=rust), LIMIT, False)
    assert encoder.max_token_id == 9
    assert encoder.encode(["a"], "none", "inputs")[0].token_ids == [0, 7]
