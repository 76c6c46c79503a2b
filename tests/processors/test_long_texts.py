"""Texts far past a token limit are found so from a part of them (processors/long_texts.py):
the tokenizer sees a small head or tail, never the whole text, and a text that fits is
always tokenised whole. Counted in characters handed to the tokenizer, never timed."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from mmserve.errors import InvalidArgument
from mmserve.frontend.prompts import PromptLimit, encode_prompt
from mmserve.processors.long_texts import MARGIN, Keep, find_long_text

_rng = random.Random(0)
WORDS = ["".join(_rng.choice("abcdefghij") for _ in range(_rng.randint(1, 9))) for _ in range(500)]
TEXT = " ".join(_rng.choice(WORDS) for _ in range(200_000))  # ~1 MB of words


def counting(encode: Callable[[str], list[int]]) -> tuple[Callable[[str], list[int]], list[int]]:
    """encode, and the lengths of the texts it was given."""
    seen: list[int] = []

    def counted(text: str) -> list[int]:
        seen.append(len(text))
        return encode(text)

    return counted, seen


def untruncated(tokenizer: Any) -> Any:
    """The tokenizer's Rust tokenizer, without the truncation its files may set."""
    from tokenizers import Tokenizer

    rust = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    rust.no_truncation()
    return rust


def words(text: str) -> list[int]:
    """A tokenizer with a token a word."""
    return [len(w) for w in text.split()]


def test_a_text_far_past_the_limit_is_found_from_a_small_head() -> None:
    encode, seen = counting(words)
    long = find_long_text(encode, TEXT, 100)
    assert long is not None and TEXT.startswith(long.part)
    assert TEXT[len(long.part)] == " "  # cut at whitespace, never inside a word
    assert 100 < long.at_least <= len(words(TEXT))
    assert sum(seen) < len(TEXT) // 50


def test_a_tail_for_left_truncation() -> None:
    encode, seen = counting(words)
    long = find_long_text(encode, TEXT, 100, keep="tail", exact=True)
    assert long is not None and TEXT.endswith(long.part) and long.part[0] == " "
    assert words(long.part)[-100:] == words(TEXT)[-100:]
    assert sum(seen) < len(TEXT) // 20


def test_a_text_that_fits_is_tokenised_whole() -> None:
    """A text of many characters a token: its heads hold too few tokens to prove anything."""
    text = " ".join(["x" * 99] * 10_000)  # 10,000 tokens in 1 MB
    encode, seen = counting(words)
    assert find_long_text(encode, text, 10_000) is None
    assert sum(seen) < len(text)  # the heads tried: at most half the text each, 4x apart
    long = find_long_text(encode, text, 100)  # its third head holds more than 100 + MARGIN
    assert long is not None and long.at_least > 100


def test_parts_near_the_limit_are_not_tried() -> None:
    """Below twice the first part's size a text is tokenised whole: the count is exact."""
    encode, seen = counting(words)
    text = TEXT[: 2 * 8 * (10 + MARGIN) - 1]
    assert find_long_text(encode, text, 10) is None and not seen


@pytest.mark.parametrize("keep", ["head", "tail"])
def test_real_tokenizers_keep_the_whole_texts_tokens(
    smollm2_tokenizer: Any, minilm_tokenizer: Any, keep: Keep
) -> None:
    """The part's kept tokens are the whole text's, and its count bounds the whole's."""
    texts = [TEXT[:300_000], "".join(_rng.choice("中文字符 😀é\u0301,.\n") for _ in range(100_000))]
    for tokenizer in (smollm2_tokenizer, minilm_tokenizer):
        rust = untruncated(tokenizer)

        def encode(text: str, rust: Any = rust) -> list[int]:
            return list(rust.encode(text, add_special_tokens=False).ids)

        for text in texts:
            whole = encode(text)
            long = find_long_text(encode, text, 300, keep, exact=True)
            assert long is not None and 300 < long.at_least <= len(whole)
            kept = encode(long.part)
            assert (kept[:300] if keep == "head" else kept[-300:]) == (
                whole[:300] if keep == "head" else whole[-300:]
            )


def test_a_tail_out_of_step_with_a_repeated_run_is_not_used(smollm2_tokenizer: Any) -> None:
    """BPE merges a run of one character from its start: a tail cut inside the run pairs it
    differently to its very end, so left truncation must tokenise all of it."""
    rust = untruncated(smollm2_tokenizer)

    def encode(text: str) -> list[int]:
        return list(rust.encode(text, add_special_tokens=False).ids)

    text = "a" * 200_001
    loose = find_long_text(encode, text, 300, "tail")
    assert loose is not None and encode(loose.part)[-300:] != encode(text)[-300:]
    assert find_long_text(encode, text, 300, "tail", exact=True) is None
    head = find_long_text(encode, text, 300, "head", exact=True)  # from the run's start: fine
    assert head is not None and encode(head.part)[:300] == encode(text)[:300]


class _Words:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, *words(text)] if add_special_tokens else words(text)


@pytest.mark.parametrize(
    "limit, message",
    [
        (PromptLimit(1000), r"^prompt: at least \d+ tokens leave no room to generate: the limit is 1000 tokens$"),
        (PromptLimit(1000, 64), r"^prompt: at least \d+ tokens exceed the server limit 64$"),
    ],
)
def test_a_prompt_far_past_its_limit_names_the_field(limit: PromptLimit, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        encode_prompt(_Words(), TEXT, True, limit, "prompt")
    short = "a few words"
    assert encode_prompt(_Words(), short, True, limit, "prompt") == [1, 1, 3, 5]
    assert limit.error("chat", 5000).message.startswith("5000 tokens")


def test_a_prompt_kept_by_its_last_tokens_is_tokenised_from_a_tail(smollm2_tokenizer: Any) -> None:
    """truncate_prompt_tokens (PromptLimit.keep_last): a text far longer is tokenised from a
    tail, whose last N ids are the whole text's (a real BPE tokenizer), not in full."""
    seen: list[int] = []

    class Spy:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            seen.append(len(text))
            return list(smollm2_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    text = TEXT[:400_000]
    whole = smollm2_tokenizer.encode(text)
    ids = encode_prompt(Spy(), text, True, PromptLimit(8192, None, keep_last=100), "prompt")
    assert ids[-100:] == whole[-100:]
    assert max(seen) < len(text) // 4
    short = "a few words"  # shorter than the kept tokens: tokenised whole
    assert encode_prompt(Spy(), short, True, PromptLimit(8192, None, keep_last=100), "prompt") == smollm2_tokenizer.encode(short)
