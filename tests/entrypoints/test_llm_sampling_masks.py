"""allowed_token_ids, bad_words and truncate_prompt_tokens end to end through the offline API,
against transformers' logits masked step by step as vLLM masks them (the bad words' token
sequences made here as vllm/logits_process.py makes them)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidArgument
from tests.entrypoints.test_llm_offline import hf_greedy, hf_model
from tests.utils.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Hello world, this is a test of a tiny tokenizer for mmserve."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("masks"), arch="llama"))


@pytest.fixture(scope="module")
def llm(tiny: str) -> LLM:
    return LLM(tiny, kv_cache_memory=16 << 20)


@torch.no_grad()
def hf_masked_greedy(
    path: str, prompt_ids: list[int], n: int, banned: Callable[[list[int]], set[int]]
) -> list[int]:
    """Greedy tokens of transformers' full forward per step, the tokens banned(output) of
    each step set to -inf first."""
    model = hf_model(path)
    ids = list(prompt_ids)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].clone()
        for t in banned(ids[len(prompt_ids) :]):
            logits[t] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


def vllm_bad_words_ids(tokenizer: object, words: list[str]) -> list[list[int]]:
    """vllm/logits_process.py, get_bad_words_logits_processors, for a Hugging Face tokenizer."""
    out: list[list[int]] = []
    for word in words:
        for add_prefix_space in (False, True):
            prompt = (" " if add_prefix_space else "") + word.lstrip()
            ids = tokenizer.encode(text=prompt, add_special_tokens=False)  # type: ignore[attr-defined]
            if not add_prefix_space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


def vllm_banned(words: list[list[int]]) -> Callable[[list[int]], set[int]]:
    """NoBadWordsLogitsProcessor's -inf tokens after these output tokens."""

    def banned(output: list[int]) -> set[int]:
        out = set()
        for word in words:
            prefix = len(word) - 1
            if prefix == 0 or (prefix <= len(output) and output[-prefix:] == word[:-1]):
                out.add(word[-1])
        return out

    return banned


def generate(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_allowed_token_ids_are_transformers_argmax_over_the_set(tiny: str, llm: LLM) -> None:
    vocab = llm.frontend.info.vocab_size
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        base = hf_greedy(tiny, ids, 12)
        # a random half of the vocabulary, without the unconstrained choices
        perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(len(prompt))).tolist()
        allowed = sorted(set(perm[: vocab // 2]) - set(base))
        out = generate(llm, ids, GREEDY.clone(max_tokens=12, allowed_token_ids=allowed))
        width = int(hf_model(tiny).config.vocab_size)  # type: ignore[union-attr]
        banned = set(range(width)) - set(allowed)  # (the logits' columns past the vocabulary too)
        assert out == hf_masked_greedy(tiny, ids, 12, vllm_banned([[t] for t in banned])), prompt
        assert set(out) <= set(allowed) and out != base


def _two_token_word(llm: LLM, base: list[int]) -> tuple[int, str] | None:
    """(i, word): a word whose vLLM token sequences include base[i : i + 2], i >= 1."""
    tok = llm.tokenizer
    for i in range(1, len(base) - 1):
        word = tok.decode(base[i : i + 2])
        if not word.strip() or "\ufffd" in word or word != word.lstrip():
            continue
        if base[i : i + 2] in vllm_bad_words_ids(tok, [word]):
            return i, word
    return None


def test_bad_words_never_complete_and_follow_vllm(tiny: str, llm: LLM) -> None:
    """A word of two tokens that the unconstrained greedy output holds: its first token is
    still generated where it was, its second never after it; every step is vLLM's mask on
    transformers' logits."""
    found = 0
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        base = generate(llm, ids, GREEDY)
        hit = _two_token_word(llm, base)
        if hit is None:
            continue
        found += 1
        i, word = hit
        words = vllm_bad_words_ids(llm.tokenizer, [word])
        out = generate(llm, ids, GREEDY.clone(bad_words=[word]))
        assert out == hf_masked_greedy(tiny, ids, len(base), vllm_banned(words)), (prompt, word)
        assert out[: i + 1] == base[: i + 1] and out[i + 1] != base[i + 1]
        assert not any(contains(out, w) for w in words)
    assert found, "no two-token word in the greedy outputs: pick other prompts"


def test_one_token_bad_word_is_never_generated(tiny: str, llm: LLM) -> None:
    tok = llm.tokenizer
    ids = tok.encode(PROMPTS[0])
    base = generate(llm, ids, GREEDY)
    t = next(
        t for t in base
        if tok.decode([t]).strip() and tok.encode(tok.decode([t]), add_special_tokens=False) == [t]
    )  # fmt: skip
    word = tok.decode([t])
    words = vllm_bad_words_ids(tok, [word])
    out = generate(llm, ids, GREEDY.clone(bad_words=[word]))
    assert t not in out and out != base
    assert out == hf_masked_greedy(tiny, ids, len(base), vllm_banned(words))


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny: str, llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[1])
    for keep in (5, len(ids), len(ids) + 3):
        result = llm.generate([ids], GREEDY.clone(truncate_prompt_tokens=keep), use_tqdm=False)[0]
        kept = ids[-keep:]
        assert result.prompt_token_ids == kept
        assert result.outputs[0].token_ids == hf_greedy(tiny, kept, 24)
    text = llm.generate(PROMPTS[1], GREEDY.clone(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert text.prompt_token_ids == ids[-5:]


def test_truncate_prompt_tokens_fits_a_prompt_past_the_context(tiny: str) -> None:
    small = LLM(tiny, max_model_len=64, kv_cache_memory=16 << 20)
    text = "Paged attention stores keys and values in fixed-size blocks. " * 40
    ids = small.tokenizer.encode(text)
    assert len(ids) > 64
    with pytest.raises(InvalidArgument):
        small.generate(text, GREEDY, use_tqdm=False)
    params = GREEDY.clone(max_tokens=8, truncate_prompt_tokens=20)
    for prompt in (text, ids):
        result = small.generate([prompt], params, use_tqdm=False)[0]
        assert result.prompt_token_ids == ids[-20:]
        assert result.outputs[0].token_ids == hf_greedy(tiny, ids[-20:], 8)
    chat = small.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0]
    assert len(chat.prompt_token_ids) == 20


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"allowed_token_ids": [1, 100_000]}, "allowed_token_ids"),
        ({"allowed_token_ids": list(range(300)) * 500}, "allowed_token_ids"),
        ({"bad_words": ["x"] * 129}, "bad_words"),
        ({"bad_words": ["ok", ""]}, "bad_words[1]"),
        ({"bad_words": ["  "]}, "bad_words[0]"),
        ({"bad_words": ["x" * 1025]}, "bad_words[0]"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_values_name_the_field(llm: LLM, params: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        llm.generate(["hi"], GREEDY.clone(**params), use_tqdm=False)
    assert e.value.field == field
    assert not llm.frontend.has_unfinished


def test_bad_words_that_ban_every_allowed_token_are_refused(llm: LLM) -> None:
    tok = llm.tokenizer
    t = tok.encode("x", add_special_tokens=False)
    assert len(t) == 1
    with pytest.raises(InvalidArgument) as e:
        llm.generate(["hi"], GREEDY.clone(allowed_token_ids=t, bad_words=["x"]), use_tqdm=False)
    assert e.value.field == "bad_words"


def test_masks_that_leave_no_token_end_the_choice(llm: LLM) -> None:
    """allowed_token_ids {a, b} with the bad words "ab" and "aa": after a, every token is masked.
    vLLM would then emit token 0 (the draw from a row of -inf); here the choice ends there,
    stopped, without it, as a grammar that leaves nothing ends one. Greedy and sampled; a plain
    request beside it is untouched. And allowed_token_ids that only EOS is in, held back by
    min_tokens: nothing to emit at all."""
    tok = llm.tokenizer
    hf = tok.hf if hasattr(tok, "hf") else tok
    a, b = hf.encode("fox", add_special_tokens=False)
    twice = hf.decode([a, a])
    assert hf.encode(twice, add_special_tokens=False) == [a, a]  # (this tokenizer: "f", "ox")
    prompt, plain_prompt = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[1])
    plain = generate(llm, plain_prompt, GREEDY)
    for params in (GREEDY.clone(max_tokens=16), SamplingParams(temperature=1.0, seed=3, max_tokens=16)):
        masked = params.clone(allowed_token_ids=[a, b], bad_words=["fox", twice], ignore_eos=True)
        outs = llm.generate([prompt, plain_prompt], [masked, GREEDY], use_tqdm=False)
        out = outs[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) < 16, out
        assert out.token_ids[-1] == a and set(out.token_ids[:-1]) <= {b}, out.token_ids
        assert 0 not in out.token_ids
        assert outs[1].outputs[0].token_ids == plain
    eos = min(llm.frontend.info.eos_token_ids)
    only_eos = GREEDY.clone(allowed_token_ids=[eos], min_tokens=4, ignore_eos=False)
    out = llm.generate([prompt], only_eos, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [] and out.finish_reason == "stop", out
