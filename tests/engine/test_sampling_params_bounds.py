"""SamplingParams.validate / validate_for_model at each bound: the last value accepted and the
first refused, the refusal an InvalidArgument naming the field (the gRPC error's field)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from mmserve.errors import InvalidArgument
from mmserve.params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PoolingParams,
    SamplingParams,
)

# field -> (values accepted, (value refused, what its message says of the limit) ...)
BOUNDS: dict[str, tuple[list[Any], list[tuple[Any, str]]]] = {
    "max_tokens": ([None, 1], [(0, ">= 1"), (-1, ">= 1")]),
    "min_tokens": ([0], [(-1, ">= 0")]),
    "temperature": ([0.0, 1e-9, 2.0], [(-1e-9, ">= 0"), (math.inf, "finite"), (math.nan, "finite")]),
    "top_p": ([1.0, 1e-6], [(0.0, "(0, 1]"), (1.0 + 1e-9, "(0, 1]"), (math.nan, "(0, 1]")]),
    "top_k": ([0, 1], [(-1, ">= 0")]),
    "min_p": ([0.0, 1.0], [(-1e-9, "[0, 1]"), (1.0 + 1e-9, "[0, 1]"), (math.nan, "[0, 1]")]),
    "repetition_penalty": ([1e-6, 5.0], [(0.0, "> 0"), (-1.0, "> 0"), (math.inf, "finite")]),
    "presence_penalty": ([-2.0, 2.0], [(-2.0 - 1e-9, "[-2, 2]"), (2.0 + 1e-9, "[-2, 2]"), (math.nan, "[-2, 2]")]),
    "frequency_penalty": ([-2.0, 2.0], [(-2.0 - 1e-9, "[-2, 2]"), (2.0 + 1e-9, "[-2, 2]"), (-math.inf, "[-2, 2]")]),
    "n": ([1, MAX_N], [(0, f"[1, {MAX_N}]"), (MAX_N + 1, f"[1, {MAX_N}]")]),
    "logprobs": ([0, MAX_LOGPROBS], [(-1, f"[0, {MAX_LOGPROBS}]"), (MAX_LOGPROBS + 1, f"[0, {MAX_LOGPROBS}]")]),
    "prompt_logprobs": ([0, MAX_LOGPROBS], [(MAX_LOGPROBS + 1, f"[0, {MAX_LOGPROBS}]")]),
    "reasoning_budget": ([None, 0], [(-1, ">= 0")]),
    "stop": ([["x"] * MAX_STOP_STRINGS], [(["x"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS}"),
                                          (["x", ""], "must not be empty")]),
    "stop_token_ids": ([[1] * MAX_STOP_TOKEN_IDS], [([1] * (MAX_STOP_TOKEN_IDS + 1), f"at most {MAX_STOP_TOKEN_IDS}")]),
    "allowed_token_ids": ([[1] * MAX_ALLOWED_TOKEN_IDS], [([1] * (MAX_ALLOWED_TOKEN_IDS + 1),
                                                           f"at most {MAX_ALLOWED_TOKEN_IDS}")]),
    "bad_words": ([["w"] * MAX_BAD_WORDS], [(["w"] * (MAX_BAD_WORDS + 1), f"at most {MAX_BAD_WORDS}")]),
    "truncate_prompt_tokens": ([None, 1], [(0, ">= 1")]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_bound_accepts_its_last_value_and_names_the_field_past_it(name: str) -> None:
    accepted, refused = BOUNDS[name]
    for value in accepted:
        SamplingParams(**{name: value}).validate()
    for value, limit in refused:
        with pytest.raises(InvalidArgument) as err:
            SamplingParams(**{name: value}).validate()
        assert err.value.field == name and limit in err.value.message, (name, value, err.value.message)


def test_min_tokens_up_to_max_tokens() -> None:
    SamplingParams(min_tokens=5, max_tokens=5).validate()
    SamplingParams(min_tokens=500, max_tokens=None).validate()  # unset: checked against the room later
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(min_tokens=6, max_tokens=5).validate()
    assert err.value.field == "min_tokens" and "max_tokens (5" in err.value.message


def test_logit_bias_and_bad_words_name_the_entry() -> None:
    SamplingParams(logit_bias={7: -100.0, 8: 100.0}).validate()
    for bias in (-100.5, 100.5, math.nan):
        with pytest.raises(InvalidArgument) as err:
            SamplingParams(logit_bias={7: bias}).validate()
        assert err.value.field == "logit_bias[7]" and "[-100, 100]" in err.value.message
    SamplingParams(bad_words=["a" * MAX_BAD_WORD_CHARS]).validate()
    for word, says in (("b" * (MAX_BAD_WORD_CHARS + 1), f"must be 1 to {MAX_BAD_WORD_CHARS}"),
                       ("", "0 characters"), (" \t", "whitespace")):  # fmt: skip
        with pytest.raises(InvalidArgument) as err:
            SamplingParams(bad_words=["ok", word]).validate()
        assert err.value.field == "bad_words[1]" and says in err.value.message


def test_greedy_below_sampling_eps_or_top_k_one() -> None:
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=1e-4).greedy and not SamplingParams(top_k=2).greedy


@pytest.mark.parametrize("name", ["stop_token_ids", "logit_bias", "allowed_token_ids"])
def test_token_ids_inside_the_vocabulary(name: str) -> None:
    def params(tok: int) -> SamplingParams:
        return SamplingParams(**{name: {tok: 1.0} if name == "logit_bias" else [tok]})

    for tok in (0, 99):
        params(tok).validate_for_model(vocab_size=100, prompt_len=1, max_model_len=64)
    for tok in (-1, 100):
        with pytest.raises(InvalidArgument) as err:
            params(tok).validate_for_model(vocab_size=100, prompt_len=1, max_model_len=64)
        assert err.value.field == name and f"token id {tok} outside [0, 100)" in err.value.message


def test_allowed_token_ids_names_the_id_outside() -> None:
    with pytest.raises(InvalidArgument, match="token id 100 outside"):
        SamplingParams(allowed_token_ids=[3, 100, 5]).validate_for_model(100, 1, 64)
    with pytest.raises(InvalidArgument, match="token id -2 outside"):
        SamplingParams(allowed_token_ids=[-2, 100]).validate_for_model(100, 1, 64)
    with pytest.raises(InvalidArgument, match="token id 100 outside"):  # 0 is inside
        SamplingParams(allowed_token_ids=[0, 100]).validate_for_model(100, 1, 64)


def test_max_tokens_fits_the_context_after_the_prompt() -> None:
    SamplingParams(max_tokens=54).validate_for_model(vocab_size=100, prompt_len=10, max_model_len=64)
    SamplingParams(max_tokens=None).validate_for_model(vocab_size=100, prompt_len=64, max_model_len=64)
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(max_tokens=55).validate_for_model(vocab_size=100, prompt_len=10, max_model_len=64)
    assert err.value.field == "max_tokens" and "prompt length 10" in err.value.message


def test_banned_after_bad_words_and_min_tokens() -> None:
    """vLLM's NoBadWordsLogitsProcessor: a one-token word always, a longer one's last token once
    the output ends with the rest; stop token ids and EOS (unless ignore_eos) while fewer than
    min_tokens are out."""
    p = SamplingParams(bad_words_token_ids=[[5], [1, 2, 3]], min_tokens=2, stop_token_ids=[9])
    eos = frozenset({0})
    assert p.banned_after([], eos) == {5, 9, 0}
    assert p.banned_after([7, 1, 2], eos) == {5, 3}  # two out: min_tokens met
    assert p.banned_after([1], eos) == {5, 9, 0}  # [1, 2] not yet
    assert p.banned_after([2], eos) == {5, 9, 0}  # the output must end with the whole [1, 2]
    assert p.banned_after([1, 2], eos) == {5, 3}  # exactly the word's other tokens; two out
    assert p.banned_after([7, 7], eos) == {5}  # min_tokens (2) out: EOS and stop ids free again
    assert p.clone(ignore_eos=True).banned_after([], eos) == {5, 9}


def test_pooling_dimensions_inside_the_embedding() -> None:
    PoolingParams(dimensions=1).validate(hidden_size=8)
    PoolingParams(dimensions=8).validate(hidden_size=8)
    for dims in (0, 9):
        with pytest.raises(InvalidArgument) as err:
            PoolingParams(dimensions=dims).validate(hidden_size=8)
        assert err.value.field == "dimensions" and ("exceeds" in err.value.message or ">= 1" in err.value.message)
    with pytest.raises(InvalidArgument) as err:
        PoolingParams(task="generate").validate()
    assert err.value.field == "task"
