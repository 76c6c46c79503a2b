from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from mmserve.processors.detokenizer import IncrementalDetokenizer
from mmserve.processors.stop_strings import StopStringMatcher

SAMPLES = [
    "Hello world, this is a test.",
    "Grüße aus Köln — naïve café, señor.",
    "日本語のテキストです。中文也可以。한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑αβγ\u200b\ttab\nnewline  ",
    "<|im_start|>assistant\nSure 😀<|im_end|>",
    "",
]


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def detokenize(
    tokenizer: Any,
    chunks: Sequence[Sequence[int]],
    prompt: Sequence[int] = (),
    skip: bool = True,
    stop: Sequence[str] = (),
    include: bool = False,
    min_tokens: int = 0,
    on_stop_token: bool = False,
) -> tuple[str, str | None, list[str]]:
    """Stream the chunks through a detokenizer; return (text, stopped_on, deltas).
    on_stop_token: the last id of the last chunk is the stop token that ended the output."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip, stop, include, min_tokens)
    deltas, stopped_on = [], None
    for i, chunk in enumerate(chunks):
        out = detok.update(chunk, on_stop_token and i == len(chunks) - 1)
        deltas.append(out.text_delta)
        stopped_on = stopped_on or out.stopped_on
    out = detok.finish()
    deltas.append(out.text_delta)
    stopped_on = stopped_on or out.stopped_on
    assert "".join(deltas) == detok.output_text
    assert stopped_on == detok.stopped_on
    return detok.output_text, stopped_on, deltas


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 5)
        chunks.append(ids[i : i + size])
        i += size
    return chunks


def test_samples_really_split_characters_across_tokens(smollm2_tokenizer: Any) -> None:
    ids = encode(smollm2_tokenizer, "😀")
    assert len(ids) == 3 and smollm2_tokenizer.decode(ids[:1]) == "\ufffd"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", SAMPLES)
def test_one_token_at_a_time_equals_decode(smollm2_tokenizer: Any, text: str, skip: bool) -> None:
    ids = encode(smollm2_tokenizer, text)
    out, stopped_on, deltas = detokenize(smollm2_tokenizer, [[i] for i in ids], skip=skip)
    assert out == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
    assert stopped_on is None
    assert not any("\ufffd" in d for d in deltas)  # never half a character


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_equal_decode(smollm2_tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    ids = encode(smollm2_tokenizer, " ".join(SAMPLES))
    out, _, _ = detokenize(smollm2_tokenizer, random_chunks(ids, rng))
    assert out == smollm2_tokenizer.decode(ids, skip_special_tokens=True)


def test_prompt_context_does_not_leak_into_output(smollm2_tokenizer: Any) -> None:
    prompt = encode(smollm2_tokenizer, "<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n")
    ids = encode(smollm2_tokenizer, "The capital of France is Paris.<|im_end|>")
    out, _, _ = detokenize(smollm2_tokenizer, [[i] for i in ids], prompt=prompt)
    assert out == "The capital of France is Paris."


def test_prompt_ending_inside_a_character(smollm2_tokenizer: Any) -> None:
    ids = encode(smollm2_tokenizer, "ok 😀 done")
    cut = next(k for k in range(len(ids)) if smollm2_tokenizer.decode(ids[:k]).endswith("\ufffd"))
    out, _, _ = detokenize(smollm2_tokenizer, [[i] for i in ids[cut:]], prompt=ids[:cut])
    assert out == smollm2_tokenizer.decode(ids[cut:])


def test_finish_releases_an_unfinished_character(smollm2_tokenizer: Any) -> None:
    ids = encode(smollm2_tokenizer, "bye 😀")[:-1]  # the model stopped mid-emoji
    out, _, deltas = detokenize(smollm2_tokenizer, [[i] for i in ids])
    assert out == smollm2_tokenizer.decode(ids) and out.endswith("\ufffd")
    assert "\ufffd" in deltas[-1]  # only `finish` emits it


def test_literal_replacement_char_at_the_end(smollm2_tokenizer: Any) -> None:
    # DecodeStream holds text ending in U+FFFD, even a real one; finish must release it.
    ids = encode(smollm2_tokenizer, "x\ufffd")
    out, _, deltas = detokenize(smollm2_tokenizer, [[i] for i in ids])
    assert out == "x\ufffd" and deltas[-1] == "\ufffd"


def test_stop_string_spanning_tokens(smollm2_tokenizer: Any) -> None:
    ids = encode(smollm2_tokenizer, "The capital of France is Paris. It is")
    stop = ["ance is Par"]  # starts inside " France", ends inside " Paris"
    out, stopped_on, deltas = detokenize(smollm2_tokenizer, [[i] for i in ids], stop=stop)
    assert (out, stopped_on) == ("The capital of Fr", "ance is Par")
    assert deltas[-1] == ""  # nothing after the stop, not even at finish
    out, _, _ = detokenize(smollm2_tokenizer, [ids], stop=stop, include=True)
    assert out == "The capital of France is Par"


def test_stop_string_at_the_very_start(smollm2_tokenizer: Any) -> None:
    ids = encode(smollm2_tokenizer, "</s> and then more text")
    out, stopped_on, deltas = detokenize(smollm2_tokenizer, [[i] for i in ids], stop=["</s>"])
    assert (out, stopped_on) == ("", "</s>")
    assert set(deltas) == {""}


def test_multiple_stop_strings_first_to_end_wins(smollm2_tokenizer: Any) -> None:
    ids = encode(smollm2_tokenizer, "alpha beta gamma delta")
    stops = ["delta", "beta gamma", "gam"]
    for chunks in ([[i] for i in ids], [ids]):
        out, stopped_on, _ = detokenize(smollm2_tokenizer, chunks, stop=stops)
        assert (out, stopped_on) == ("alpha beta ", "gam")


def test_stop_string_inside_a_split_emoji(smollm2_tokenizer: Any) -> None:
    ids = encode(smollm2_tokenizer, "smile 😀 please")
    out, stopped_on, _ = detokenize(smollm2_tokenizer, [[i] for i in ids], stop=["😀"])
    assert (out, stopped_on) == ("smile ", "😀")


def test_held_back_text_is_released_when_it_does_not_match(smollm2_tokenizer: Any) -> None:
    ids = encode(smollm2_tokenizer, "Paris is nice. Par")
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], True, ["Paris!"], False)
    shown = "".join(detok.update([i]).text_delta for i in ids)
    assert shown == "Paris is nice. "  # "Par" could still become "Paris!"
    assert detok.finish().text_delta == "Par"
    assert detok.update(ids).text_delta == ""  # finished: later ids are ignored


def test_special_tokens_kept_or_skipped(smollm2_tokenizer: Any) -> None:
    ids = encode(smollm2_tokenizer, "Hi<|im_end|>")
    assert detokenize(smollm2_tokenizer, [[i] for i in ids], skip=True)[0] == "Hi"
    assert detokenize(smollm2_tokenizer, [[i] for i in ids], skip=False)[0] == "Hi<|im_end|>"


@pytest.mark.parametrize("skip", [True, False])
def test_the_stop_token_shows_text_only_when_asked(smollm2_tokenizer: Any, skip: bool) -> None:
    # vLLM's test_stop_token_ids: the EOS or stop token id that ended the output is not text
    ids = encode(smollm2_tokenizer, "hello world<|im_end|>")
    for chunks in ([[i] for i in ids], [ids], [ids[:1], ids[1:]]):
        out, _, _ = detokenize(smollm2_tokenizer, chunks, skip=skip, on_stop_token=True)
        assert out == "hello world"
        out, _, _ = detokenize(smollm2_tokenizer, chunks, (), skip, (), True, 0, True)
        assert out == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
    world = encode(smollm2_tokenizer, "hello world")  # a stop token that is not special
    assert detokenize(smollm2_tokenizer, [world], on_stop_token=True)[0] == "hello"


def test_min_tokens_keeps_stop_strings_out_of_the_first_tokens(smollm2_tokenizer: Any) -> None:
    # vLLM's test_min_tokens (facebook/opt-125m there; SmolLM2 splits this text alike)
    ids = encode(smollm2_tokenizer, "Hello, my name is Lee, and I'm a student in the college")
    prompt, out_ids = ids[:4], ids[4:]
    cases = [(0, (" is L", "e")), (5, (" is Lee, and I'm a stud", "e"))]
    for min_tokens, expected in [*cases, (99, (smollm2_tokenizer.decode(out_ids), None))]:
        for chunks in ([[i] for i in out_ids], [out_ids], [out_ids[:3], out_ids[3:]]):
            got = detokenize(smollm2_tokenizer, chunks, prompt, stop=["e"], min_tokens=min_tokens)
            assert got[:2] == expected


def test_defaults_skip_special_tokens_hide_the_stop_token_and_stop_at_once(smollm2_tokenizer: Any) -> None:
    """The keyword defaults are SamplingParams' (skip_special_tokens, include_stop_str_in_output
    off, min_tokens 0), for callers that leave them out."""
    ids = encode(smollm2_tokenizer, "Hi there<|im_end|>")
    assert IncrementalDetokenizer(smollm2_tokenizer, []).update(ids).text_delta == "Hi there"
    shown = IncrementalDetokenizer(smollm2_tokenizer, []).update(ids[:-1], ends_on_stop_token=True)
    assert shown.text_delta == smollm2_tokenizer.decode(ids[:-2])  # " there" ended it: not text
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], stop=["H"])
    assert detok.update(ids[:1]) == ("", "H")


def test_min_tokens_counts_hidden_ids(smollm2_tokenizer: Any) -> None:
    # the tool stream's second detokenisation hides special tokens but counts them
    ids = encode(smollm2_tokenizer, "<|im_start|>a b")  # <|im_start|> "a" " b"
    hidden = frozenset({ids[0]})
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], False, ["a"], False, 2, hidden)
    assert detok.update(ids).text_delta == "a b" and detok.stopped_on is None
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], False, ["a"], False, 1, hidden)
    assert detok.update(ids).text_delta == "" and detok.stopped_on == "a"


# vLLM's tests/tokenizers_/test_detokenize.py: its TRUTH texts, with and without a prompt
VLLM_TRUTH = [
    "Hello here, this is a simple test",
    "vLLM is a high-throughput and memory-efficient inference and serving engine for LLMs.",
    "我很感谢你的热情",
    "ပုံပြင်လေးပြောပြပါ်",  # Burmese: tokens that end inside a character
    "URGENCY🌶️",
    "Some text with adjacent special tokens   <|im_start|><|im_end|>other text<|endoftext|>",
]
TOKENIZERS = [
    "smollm2_tokenizer", "llama3_tokenizer", "minilm_tokenizer", "byte_fallback_tokenizer"
]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("truth", VLLM_TRUTH)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("with_prompt", [True, False])
def test_vllm_decode_streaming(
    request: pytest.FixtureRequest, name: str, truth: str, skip: bool, with_prompt: bool
) -> None:
    tokenizer = request.getfixturevalue(name)
    ids = encode(tokenizer, truth)
    ids = [t for t in (tokenizer.bos_token_id,) if t is not None] + ids
    ids += [t for t in (tokenizer.eos_token_id,) if t is not None]
    whole = tokenizer.decode(ids, skip_special_tokens=skip)
    cut = len(encode(tokenizer, truth[: len(truth) // 2])) + 1 if with_prompt else 0
    prompt_text = tokenizer.decode(ids[:cut], skip_special_tokens=skip)
    assert whole.startswith(prompt_text)
    for chunks in ([[i] for i in ids[cut:]], [ids[cut:]]):
        out, _, deltas = detokenize(tokenizer, chunks, ids[:cut], skip=skip)
        assert out == whole[len(prompt_text) :]
        assert not any("\ufffd" in d for d in deltas)


def test_stop_string_inside_a_byte_fallback_emoji(byte_fallback_tokenizer: Any) -> None:
    tokenizer = byte_fallback_tokenizer
    ids = encode(tokenizer, "smile 😀 please 日本")
    tokens = tokenizer.convert_ids_to_tokens(ids)
    at = tokens.index("<0xF0>")
    assert tokens[at : at + 4] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    for stop, text in [("😀", "smile "), (" 😀 p", "smile"), ("本", "smile 😀 please 日")]:
        for chunks in ([[i] for i in ids], [ids[: at + 2], ids[at + 2 :]], [ids]):
            for include in (False, True):
                got = detokenize(tokenizer, chunks, stop=[stop], include=include)
                assert got[:2] == (text + stop if include else text, stop)
                assert not any("\ufffd" in d for d in got[2])


def test_wordpiece_with_prompt_context(minilm_tokenizer: Any) -> None:
    # WordPiece joins tokens with spaces: the first output token needs the prompt as context.
    prompt = encode(minilm_tokenizer, "the answer is")
    ids = encode(minilm_tokenizer, "unbelievably simple, isn't it?")
    out, _, _ = detokenize(minilm_tokenizer, [[i] for i in ids], prompt=prompt)
    backend = minilm_tokenizer.backend_tokenizer
    assert out == backend.decode(prompt + ids)[len(backend.decode(prompt)) :]


def test_decoder_rewriting_earlier_text_restarts_the_stream() -> None:
    # Fuse + Replace rewrites "ab" -> "X" after "a" was shown: DecodeStream raises
    # "Invalid prefix"; the detokenizer restarts and keeps going without losing text.
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    out, _, _ = detokenize(tokenizer, [[0], [1], [2], [0]])
    assert out == "abca"


# Property tests. database=None: hypothesis must not write files into the repository.
ALPHABET = "ab \n😀👍🏽日本éß\u200d"
texts = st.text(st.sampled_from(ALPHABET), max_size=14)
stop_lists = st.lists(st.text(st.sampled_from(ALPHABET), min_size=1, max_size=4), max_size=3)


def cut_at_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    # The whole text in one chunk; test_stop_strings checks the matcher against brute force.
    matcher = StopStringMatcher(stops, include)
    released, stopped_on = matcher.push(text)
    return released + matcher.flush(), stopped_on


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = [0, *sorted(cuts), len(ids)]
    return [ids[i:j] for i, j in itertools.pairwise(bounds)]


@settings(max_examples=60, deadline=None, database=None)
@given(text=texts, skip=st.booleans(), data=st.data())
def test_property_random_chunks(
    smollm2_tokenizer: Any, text: str, skip: bool, data: st.DataObject
) -> None:
    ids = encode(smollm2_tokenizer, text + "<|im_end|>")
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=8))
    out, _, deltas = detokenize(smollm2_tokenizer, split(ids, cuts), skip=skip)
    assert out == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)


def quiet_chars(tokenizer: Any, ids: list[int], min_tokens: int) -> int:
    """How many characters of the output's text no stop string may end in: all of it when the
    output has no more than min_tokens ids (its unfinished tail included), else the text the first
    min_tokens ids released. A character a later id completes is that id's, the whole token it
    began in with it (" \xf0\x9f\x98" then "\x80": the space comes with the second), as in vLLM."""
    if len(ids) <= min_tokens:
        return len(tokenizer.decode(ids))
    released = max(j for j in range(min_tokens + 1) if not tokenizer.decode(ids[:j]).endswith("\ufffd"))
    return len(tokenizer.decode(ids[:released]))


def test_min_tokens_and_a_character_completed_later(smollm2_tokenizer: Any) -> None:
    """" \xf0\x9f\x98" carries a space and the first bytes of 😀: its text comes with the id that
    completes the character, so min_tokens = 1 lets a stop string end in the space; an output cut
    inside the character releases it at finish, as the last id's text."""
    ids = encode(smollm2_tokenizer, "a 😀")
    assert [smollm2_tokenizer.decode([i]) for i in ids] == ["a", " \ufffd", "\ufffd"]
    assert detokenize(smollm2_tokenizer, [ids[1:]], min_tokens=1, stop=[" "])[:2] == ("", " ")
    cut = ids[:2]  # the model stopped inside 😀
    for min_tokens, expected in [(1, ("a", " ")), (2, ("a \ufffd", None)), (3, ("a \ufffd", None))]:
        assert quiet_chars(smollm2_tokenizer, cut, min_tokens) == (1 if min_tokens == 1 else 3)
        for chunks in ([cut], [[i] for i in cut]):
            got = detokenize(smollm2_tokenizer, chunks, min_tokens=min_tokens, stop=[" "])
            assert got[:2] == expected


@settings(max_examples=60, deadline=None, database=None)
@given(text=texts, stops=stop_lists, include=st.booleans(), cut=st.booleans(), data=st.data())
def test_property_min_tokens_at_every_split(
    smollm2_tokenizer: Any, text: str, stops: list[str], include: bool, cut: bool, data: st.DataObject
) -> None:
    ids = encode(smollm2_tokenizer, text)
    if cut:  # the output may end inside a character: `finish` releases its bytes
        ids = ids[:-1]
    min_tokens = data.draw(st.integers(0, len(ids) + 1))
    full = smollm2_tokenizer.decode(ids)
    quiet = quiet_chars(smollm2_tokenizer, ids, min_tokens)
    matcher = StopStringMatcher(stops, include)
    first = matcher.push(full[:quiet], may_stop=False)[0]
    released, stopped_on = matcher.push(full[quiet:])
    expected = (first + released + matcher.flush(), stopped_on)
    for i in range(len(ids) + 1):
        chunks = [ids[:i], ids[i:]]
        got = detokenize(smollm2_tokenizer, chunks, (), True, stops, include, min_tokens)
        assert got[:2] == expected


@settings(max_examples=40, deadline=None, database=None)
@given(text=texts, stops=stop_lists, include=st.booleans())
def test_property_stops_at_every_split(
    smollm2_tokenizer: Any, text: str, stops: list[str], include: bool
) -> None:
    ids = encode(smollm2_tokenizer, text)
    expected = cut_at_stop(smollm2_tokenizer.decode(ids), stops, include)
    for i in range(len(ids) + 1):
        got = detokenize(smollm2_tokenizer, [ids[:i], ids[i:]], (), True, stops, include)
        assert got[:2] == expected
