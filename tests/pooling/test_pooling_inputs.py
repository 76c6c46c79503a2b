"""Tokenising and truncating pooling inputs at the edge (MiniLM's WordPiece tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mmserve.errors import InvalidArgument
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
