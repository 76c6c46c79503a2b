"""Each sampling parameter has a test that fails if the parameter were ignored."""

from __future__ import annotations

import collections

import pytest
import torch

from mmserve.params import SamplingParams
from mmserve.runner.sampler import SamplingRow, argmax, sample


def row(prompt=(), output=(), eos=(), seed=None, **kw) -> SamplingRow:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), frozenset(eos), gen)


def draw(logits: list[float], n: int = 400, **kw) -> collections.Counter:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    t = torch.tensor([logits] * n)
    tokens, _ = sample(t, [row(**kw) for _ in range(n)], g)
    return collections.Counter(tokens)


LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]


def test_greedy_and_top_k_1() -> None:
    assert set(draw(LOGITS, temperature=0.0)) == {0}
    assert set(draw(LOGITS, temperature=1.0, top_k=1)) == {0}
    assert len(draw(LOGITS, temperature=1.0)) > 3  # sanity: sampling does spread


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_is_torchs_first_largest_index(dtype: torch.dtype) -> None:
    """sampler.argmax (torch.max's indices on the CPU) picks what torch.argmax picks: the first
    of tied largest values, a NaN over any number, and index 0 of a row of -inf."""
    g = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 1), (3, 7), (16, 4099), (5, 49152)]:
        x = torch.randint(-3, 3, (rows, vocab), generator=g).to(dtype)  # ties everywhere
        if vocab > 7:
            x[0, vocab // 3] = float("nan")
            x[-1] = -float("inf")
        assert torch.equal(argmax(x), x.argmax(dim=-1)), (rows, vocab)
    tied = torch.tensor([[1.0, 5.0, 5.0, 2.0], [5.0, 0.0, 5.0, 5.0]], dtype=dtype)
    assert argmax(tied).tolist() == [1, 0]


def test_temperatures_too_small_to_divide_by_are_greedy() -> None:
    # 1 / 1e-300 is inf in float32: the logits became nan and token 0 came out every time
    for t in (1e-300, 5e-324, 1e-6):
        assert set(draw(LOGITS[::-1], temperature=t)) == {len(LOGITS) - 1}, t
    # beside sampled rows, which keep their distribution
    g = torch.Generator().manual_seed(1)
    rows = [row(temperature=1e-300), row(temperature=1.0)] * 200
    tokens, _ = sample(torch.tensor([LOGITS[::-1]] * 400), rows, g)
    assert set(tokens[::2]) == {len(LOGITS) - 1} and len(set(tokens[1::2])) > 3


def test_temperature() -> None:
    cold = draw(LOGITS, temperature=0.05)
    hot = draw(LOGITS, temperature=5.0)
    assert cold[0] > 390
    assert hot[0] < 150 and len(hot) == 6


def test_top_k() -> None:
    assert set(draw(LOGITS, top_k=2)) == {0, 1}


def test_top_p() -> None:
    probs = torch.tensor(LOGITS).softmax(0)  # 0.38, 0.23, 0.14, ...
    assert probs[0] < 0.5 < probs[0] + probs[1]
    assert set(draw(LOGITS, top_p=0.5)) == {0, 1}
    assert set(draw(LOGITS, top_p=0.3)) == {0}


def test_min_p() -> None:
    # p(2)/p(0) = e^-1 = 0.37, p(3)/p(0) = 0.22
    assert set(draw(LOGITS, min_p=0.3)) == {0, 1, 2}


def test_logit_bias_forces_token() -> None:
    assert set(draw(LOGITS, temperature=0.0, logit_bias={5: 100.0})) == {5}
    assert set(draw(LOGITS, logit_bias={5: 100.0})) == {5}


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = [0.0, 0.0, 10.0, 9.0, 0.0, 0.0]
    assert set(draw(logits, temperature=0.0, eos=[2], min_tokens=1)) == {3}
    assert set(draw(logits, temperature=0.0, eos=[2], min_tokens=1, stop_token_ids=[3])) == {0}
    # min_tokens reached: eos allowed again
    assert set(draw(logits, temperature=0.0, eos=[2], min_tokens=1, output=[1])) == {2}


def test_repetition_penalty_hf_semantics() -> None:
    logits = [2.0, 1.5, -1.0, 0.0, 0.0, 0.0]
    assert set(draw(logits, temperature=0.0, prompt=[0], repetition_penalty=2.0)) == {1}
    t = torch.tensor([logits])
    _, lp = sample(t, [row(prompt=[2], repetition_penalty=2.0, temperature=0.0, logprobs=1)])
    assert lp[0] is not None  # logprobs come from the raw distribution
    assert abs(lp[0].logprob - float(t.log_softmax(-1)[0, 0])) < 1e-6


def test_presence_and_frequency_penalties() -> None:
    logits = [2.0, 1.5, 1.0, 0.0, 0.0, 0.0]
    assert set(draw(logits, temperature=0.0, output=[0], presence_penalty=1.0)) == {1}
    assert set(draw(logits, temperature=0.0, output=[0], frequency_penalty=0.4)) == {0}
    assert set(draw(logits, temperature=0.0, output=[0, 0], frequency_penalty=0.4)) == {1}
    # presence/frequency only look at output, not the prompt
    assert set(draw(logits, temperature=0.0, prompt=[0], presence_penalty=2.0)) == {0}


def test_seed_reproducible_whatever_the_batch() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))

    def run(batch_before: int, batch_after: int, seed: int) -> list[int]:
        r = row(seed=seed, temperature=1.0)
        toks = []
        for step in range(20):
            n = batch_before + 1 + batch_after
            others = torch.randn(n, 50)
            others[batch_before] = logits[0]
            rows = [row(temperature=1.0) for _ in range(n)]
            rows[batch_before] = r
            out, _ = sample(others, rows, torch.Generator().manual_seed(step + n))
            toks.append(out[batch_before])
        return toks

    a = run(0, 0, seed=7)
    assert a == run(3, 5, seed=7)
    assert a != run(0, 0, seed=8)
    assert len(set(a)) > 1


def test_logprobs_rank_and_top() -> None:
    t = torch.tensor([LOGITS])
    tokens, lp = sample(t, [row(temperature=0.0, logit_bias={3: 100.0}, logprobs=3)])
    assert tokens == [3]
    ref = t.log_softmax(-1)[0]
    assert lp[0] is not None
    assert lp[0].rank == 4 and abs(lp[0].logprob - float(ref[3])) < 1e-6
    assert [i for i, _ in lp[0].top] == [0, 1, 2]


def test_logprobs_of_a_batch_row_by_row() -> None:
    """Rows asking 1, 3 or 7 alternatives beside rows asking none, after bias: each row's
    entry is its own (from the raw distribution), none for the others."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=gen) * 2
    asks = [3, 0, 1, 7, 0, 3]
    rows = [row(temperature=0.0, logprobs=k, logit_bias={i: 50.0}) for i, k in enumerate(asks)]
    tokens, lp = sample(logits, rows)
    assert tokens == [0, 1, 2, 3, 4, 5]
    raw = logits.log_softmax(-1)
    for i, k in enumerate(asks):
        got = lp[i]
        if not k:
            assert got is None
            continue
        assert got is not None and got.token_id == i
        assert got.logprob == pytest.approx(float(raw[i, i]), abs=1e-6)
        assert got.rank == int((raw[i] > raw[i, i]).sum()) + 1
        assert [t for t, _ in got.top] == raw[i].topk(k).indices.tolist()
        assert [v for _, v in got.top] == pytest.approx(raw[i].topk(k).values.tolist(), abs=1e-6)


def _plain_rows(rng: torch.Generator, n: int, **extra) -> list[SamplingRow]:  # type: ignore[no-untyped-def]
    """Rows without bias or penalties: greedy, random, top-k/p/min-p, seeded or not."""
    out = []
    for i in range(n):
        kind = int(torch.randint(0, 4, (1,), generator=rng))
        kw = [
            {"temperature": 0.0},
            {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.01},
            {"temperature": 1.3, "top_k": 1},
            {"temperature": 1.0},
        ][kind]
        out.append(row(seed=i if i % 3 == 0 else None, output=[1, 2], **kw, **extra))
    return out


def test_fast_paths_equal_the_general_path() -> None:
    """Plain rows skip the per-row work; forcing it (a min_tokens that masks nothing, and
    logprobs) must give the same tokens, greedy or random, all of a kind or mixed."""
    rng = torch.Generator().manual_seed(0)
    for step in range(30):
        n = [1, 7, 64][step % 3]
        logits = torch.randn(n, 97, generator=rng) * 3
        before = logits.clone()
        seed_state = int(torch.randint(0, 2**31, (1,), generator=rng))
        if step % 5 == 0:  # all greedy
            params: dict = {"temperature": 0.0}
            fast_rows, slow_rows = (
                [row(**params) for _ in range(n)],
                [row(min_tokens=9, logprobs=2, **params) for _ in range(n)],
            )
        else:
            fast_rows = _plain_rows(torch.Generator().manual_seed(step), n)
            slow_rows = _plain_rows(
                torch.Generator().manual_seed(step), n, min_tokens=9, logprobs=2
            )
        fast, fast_lp = sample(logits, fast_rows, torch.Generator().manual_seed(seed_state))
        slow, slow_lp = sample(logits, slow_rows, torch.Generator().manual_seed(seed_state))
        assert fast == slow
        assert fast_lp == [None] * n and all(lp is not None for lp in slow_lp)
        assert torch.equal(logits, before)  # the caller's logits are never modified
        if step % 5 == 0:
            assert fast == logits.argmax(-1).tolist()


def test_bias_on_some_rows_leaves_the_others_alone() -> None:
    logits = torch.tensor([LOGITS] * 3)
    rows = [row(temperature=0.0), row(temperature=0.0, logit_bias={4: 50.0}), row(temperature=0.0)]
    tokens, _ = sample(logits, rows)
    assert tokens == [0, 4, 0]
    assert torch.equal(logits, torch.tensor([LOGITS] * 3))


def definition(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's distribution written out from the parameters' meaning, in float64: the
    top_k most likely tokens, renormalised; of those the smallest set whose mass reaches
    top_p; of those the tokens of at least min_p times the most likely one's probability."""
    scaled = logits.double() / (params.temperature or 1.0)
    probs = scaled.softmax(0)
    order = probs.argsort(descending=True)
    ranked = probs[order]
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if 0 < params.top_k < len(ranked):
        keep[params.top_k :] = False
    renorm = torch.where(keep, ranked, 0.0)
    renorm = renorm / renorm.sum()
    if params.top_p < 1.0:
        keep &= renorm.cumsum(0) - renorm < params.top_p
    keep &= renorm >= params.min_p * renorm[0]
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = probs[order[keep]]
    return out / out.sum()


def test_filtered_distributions_follow_the_definition(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every mix of top-k / top-p / min-p, on a vocabulary past the CPU's topk prefix, peaked
    rows (the prefix holds every kept token) and flat ones (it does not: the whole row is
    sorted), and a vocabulary smaller than the prefix."""
    from mmserve.runner import sampler

    split: list[tuple[int, int]] = []  # (rows that took the prefix, rows sorted whole)
    real = sampler._prefix_rows

    def spy(*args):  # type: ignore[no-untyped-def]
        got = real(*args)
        split.append((sum(len(where) for where, _, _ in got[0]), len(got[1])))
        return got

    monkeypatch.setattr(sampler, "_prefix_rows", spy)
    gen = torch.Generator().manual_seed(0)
    kinds = [
        {}, {"top_k": 50}, {"top_k": 3000}, {"top_p": 0.9}, {"top_p": 0.995}, {"min_p": 0.05},
        {"min_p": 1e-4}, {"top_k": 40, "top_p": 0.8, "min_p": 0.02}, {"top_k": 2000, "top_p": 0.7},
        {"temperature": 0.7, "top_p": 0.95}, {"top_p": 0.5, "min_p": 0.3},
    ]  # fmt: skip
    for vocab, spread in [(5000, 6.0), (5000, 0.3), (500, 2.0)]:
        params = [SamplingParams(**kw) for kw in kinds]
        logits = torch.randn(len(params), vocab, generator=gen) * spread
        got = sampler._filtered_probs(logits, [row(**kw) for kw in kinds])
        for i, p in enumerate(params):
            want = definition(logits[i], p)
            assert torch.equal(got[i] > 0, want > 0), (vocab, spread, kinds[i])
            torch.testing.assert_close(got[i].double(), want, atol=1e-6, rtol=1e-4)
        # every row filtering (the first is the one that does not): the same rows
        only_filtering = sampler._filtered_probs(logits[1:], [row(**kw) for kw in kinds[1:]])
        torch.testing.assert_close(only_filtering, got[1:], atol=1e-7, rtol=1e-6)
    # (the 10 rows that filter; the prefix is 3,000 wide, the largest top_k.) Peaked: all of
    # them took the prefix. Flat: the four with a top_k and top_p 0.5, which the prefix's
    # mass (about 0.71) reaches; the other five were sorted whole in the same call. 500
    # tokens: the prefix would be all of them (and top_k 3000 filters nothing there)
    assert split[::2] == [(10, 0), (5, 5), (0, 9)] and split[1::2] == split[::2]


def test_cpu_noise_draws_the_distribution() -> None:
    """argmax(p / E) with the CPU's -log(U) noise picks token t with probability p(t)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    tokens = sampler_draw(p.repeat(n, 1), n)
    counts = torch.bincount(tokens, minlength=5).double() / n
    sigma = (p * (1 - p) / n).sqrt()
    assert counts[4] == 0
    assert ((counts - p).abs() <= 5 * sigma + 1e-12).all(), counts


def sampler_draw(probs: torch.Tensor, n: int) -> torch.Tensor:
    from mmserve.runner.sampler import draw

    return draw(probs, [row() for _ in range(n)], torch.Generator().manual_seed(3))


def penalised_one_row_at_a_time(row_logits: torch.Tensor, r: SamplingRow) -> None:
    """The penalties as one row's torch operations (the code the batched one replaced)."""
    params = r.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long)
        if seen.numel():
            vals = row_logits[seen]
            p = params.repetition_penalty
            row_logits[seen] = torch.where(vals > 0, vals / p, vals * p)
    if (params.presence_penalty or params.frequency_penalty) and r.output_token_ids:
        counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=row_logits.numel())
        row_logits -= params.frequency_penalty * counts.to(row_logits.dtype)
        row_logits -= params.presence_penalty * (counts > 0).to(row_logits.dtype)


def test_batched_penalties_equal_one_row_at_a_time() -> None:
    """Bit for bit, for rows with each penalty, both, none, repeated tokens, an empty output,
    and the prompt's ids given as the runner keeps them or taken from the prompt."""
    from mmserve.runner.sampler import _apply_penalties

    gen = torch.Generator().manual_seed(5)
    vocab = 300
    kinds = [
        {"repetition_penalty": 1.3}, {"presence_penalty": 0.7}, {"frequency_penalty": -0.4},
        {"repetition_penalty": 0.8, "presence_penalty": 0.2, "frequency_penalty": 0.5}, {},
        {"repetition_penalty": 2.0, "frequency_penalty": 1.0},
    ]  # fmt: skip
    rows = []
    for i, kw in enumerate(kinds * 2):
        prompt = torch.randint(0, vocab, (int(torch.randint(0, 60, (1,), generator=gen)),), generator=gen)
        output = torch.randint(0, 40, (0 if i == 5 else 25,), generator=gen).tolist()  # repeats
        cached = prompt.unique() if i % 2 else None
        rows.append(SamplingRow(SamplingParams(**kw), prompt.tolist(), output, frozenset(), None, None, cached))
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    expected = logits.clone()
    for i, r in enumerate(rows):
        penalised_one_row_at_a_time(expected[i], r)
    got = logits.clone()
    which = [i for i in range(len(rows)) if i != 7]  # a row not listed is left alone
    _apply_penalties(got, rows, which)
    expected[7] = logits[7]
    assert torch.equal(got, expected)


def test_batched_bias_and_min_tokens_equal_one_row_at_a_time() -> None:
    """logit_bias and min_tokens' bans for all rows in one indexed add and one indexed write:
    bit for bit what each row's own operations gave, with the penalties after them."""
    from mmserve.runner.sampler import _adjusted, _adjusts_logits

    gen = torch.Generator().manual_seed(9)
    kinds = [
        {"logit_bias": {3: 2.5, 7: -1.0, 299: 100.0}}, {"min_tokens": 30, "stop_token_ids": [5, 6]},
        {"min_tokens": 30, "ignore_eos": True}, {"min_tokens": 30, "ignore_eos": True, "stop_token_ids": [9]},
        {"min_tokens": 2, "logit_bias": {5: -3.0}}, {"logit_bias": {11: 1.0}, "repetition_penalty": 1.5},
        {"min_tokens": 30, "presence_penalty": 0.5, "logit_bias": {1: 0.25}},
    ]  # fmt: skip
    rows = [row(output=[1, 2, 3, 3], eos=(0, 4), prompt=(7, 8, 9), **kw) for kw in kinds]
    logits = torch.randn(len(rows), 300, generator=gen)
    expected = logits.clone()
    for i, r in enumerate(rows):
        params = r.params
        for t, b in params.logit_bias.items():
            expected[i, t] += b
        if len(r.output_token_ids) < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(r.eos_token_ids))
            for t in banned:
                expected[i, t] = float("-inf")
        penalised_one_row_at_a_time(expected[i], r)
    adjusted = [i for i, r in enumerate(rows) if _adjusts_logits(r)]
    assert adjusted == [0, 1, 3, 4, 5, 6]  # row 2 bans nothing; row 4's min_tokens has passed
    assert torch.equal(_adjusted(logits, rows, adjusted), expected)


def test_allowed_token_ids_restrict_greedy_and_drawn_tokens() -> None:
    assert set(draw(LOGITS, temperature=0.0, allowed_token_ids=[3, 5])) == {3}
    drawn = draw(LOGITS, allowed_token_ids=[2, 4])
    assert set(drawn) == {2, 4}  # both drawn, nothing else
    assert drawn[2] > drawn[4]  # in their own proportion (e^1 : e^0)


def test_allowed_token_ids_leave_logprobs_raw() -> None:
    """As logit_bias: the logprobs are the model's own distribution's."""
    t = torch.tensor([LOGITS])
    tokens, lp = sample(t, [row(temperature=0.0, allowed_token_ids=[4], logprobs=2)])
    assert tokens == [4]
    raw = torch.log_softmax(t, dim=-1)[0]
    assert lp[0] is not None and lp[0].logprob == pytest.approx(raw[4].item())
    assert lp[0].rank == 5 and [i for i, _ in lp[0].top] == [0, 1]


def test_bad_words_follow_vllms_processor() -> None:
    """A one-token word is always masked; a longer one's last token only where the output
    ends with its other tokens (vLLM's NoBadWordsLogitsProcessor)."""
    words = [[0], [3, 1], [2, 3, 1], [5, 4, 2]]

    def greedy(output: list[int]) -> int:
        tokens, _ = sample(
            torch.tensor([LOGITS]),
            [row(output=output, temperature=0.0, bad_words_token_ids=words)],
        )
        return tokens[0]

    assert greedy([]) == 1  # 0 banned; [3, 1] needs a 3 before it
    assert greedy([4, 3]) == 2  # now 1 is banned too
    assert greedy([2]) == 1  # [3, 1]'s prefix is not [2]
    assert greedy([5, 4]) == 1  # [5, 4, 2]'s 2 is banned, 1 was not: 1 stays the best
    logits = [0.0, -1.0, 3.0, 0.0, 0.0, 0.0]
    tokens, _ = sample(
        torch.tensor([logits, logits]),
        [row(output=[5, 4], temperature=0.0, bad_words_token_ids=words),
         row(output=[4, 4], temperature=0.0, bad_words_token_ids=words)],
    )  # fmt: skip
    assert tokens[0] != 2 and tokens[1] == 2  # the prefix is the output's last tokens


def test_batched_masks_equal_one_row_at_a_time() -> None:
    """allowed_token_ids and bad_words for all rows at once: what each row alone gives, beside
    rows with bias and penalties, with a grammar-like -inf already in the logits."""
    from mmserve.runner.sampler import _adjusted, _adjusts_logits

    gen = torch.Generator().manual_seed(5)
    kinds = [
        {"allowed_token_ids": [3, 7, 299]}, {"bad_words_token_ids": [[4], [3, 3, 9]]},
        {"logit_bias": {11: 1.0}, "repetition_penalty": 1.5},
        {"allowed_token_ids": list(range(0, 300, 2)), "bad_words_token_ids": [[2], [3, 8]],
         "presence_penalty": 0.5},
        {"allowed_token_ids": [1], "min_tokens": 30},
    ]  # fmt: skip
    rows = [row(output=[1, 2, 3, 3], eos=(0,), prompt=(7, 8), **kw) for kw in kinds]
    logits = torch.randn(len(rows), 300, generator=gen)
    logits[:, 150] = float("-inf")
    expected = logits.clone()
    for i, r in enumerate(rows):
        params = r.params
        for t, b in params.logit_bias.items():
            expected[i, t] += b
        if params.allowed_token_ids:
            keep = torch.full((300,), float("-inf"))
            keep[params.allowed_token_ids] = 0.0
            expected[i] += keep
        out = r.output_token_ids
        for word in params.bad_words_token_ids:
            if len(word) == 1 or out[-(len(word) - 1):] == word[:-1]:
                expected[i, word[-1]] = float("-inf")
        if len(out) < params.min_tokens:
            expected[i, 0] = float("-inf")
        penalised_one_row_at_a_time(expected[i], r)
    adjusted = [i for i, r in enumerate(rows) if _adjusts_logits(r)]
    assert adjusted == [0, 1, 2, 3, 4]
    got = _adjusted(logits, rows, adjusted)
    assert torch.equal(got, expected)
    assert torch.isinf(got[1, 4]) and torch.isinf(got[1, 9]) and not torch.isinf(got[1, 8])
    assert torch.isinf(got[3, 8]) and torch.isinf(got[3, 3]) and not torch.isinf(got[3, 10])
    assert torch.isinf(got[4]).sum() == 300 - 1  # only token 1 left
