"""Turns logits into tokens: logit bias, min_tokens, allowed_token_ids, bad_words, penalties,
temperature, top-k, top-p, min-p, per-request seeds, and logprobs. Rows are independent: a row's result never depends on
what else is in the batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.outputs import TokenLogprob
from mmserve.params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the logits to sample from."""

    params: SamplingParams
    prompt_token_ids: list[int]  # for the repetition penalty
    output_token_ids: list[int]  # for penalties and min_tokens
    eos_token_ids: frozenset[int]  # masked while fewer than min_tokens are out
    generator: torch.Generator | None  # the request's own, when it has a seed
    # the generator is seeded with this before the row's draw: the request's seed mixed with
    # the output position the row samples, so a seeded output depends on nothing else (not
    # on the batch, nor on how many positions speculative decoding checked in a step)
    position_seed: int | None = None
    # the prompt's distinct token ids on the logits' device, for the repetition penalty: the
    # runner keeps them per request (a long prompt is not converted again every step); None:
    # taken from prompt_token_ids
    prompt_ids: torch.Tensor | None = None
    # params.allowed_token_ids on the logits' device, int64, kept per request by the runner
    # like prompt_ids; None: taken from params
    allowed_ids: torch.Tensor | None = None
    # _banned's set, made the first time it is asked (a row is made for one step: its output
    # does not change; the fast path's check and the mask both ask)
    banned: set[int] | None = None


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [N, V] float32, one row per entry of rows. Returns the sampled token ids and, for
    rows that asked, their logprobs (taken from the raw model distribution)."""
    tokens, logprobs = sample_on_device(logits, rows, generator)
    return tokens.tolist(), logprobs


def sample_on_device(
    logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None
) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
    """sample(), with the tokens left on the logits' device ([N] int64): nothing waits for the
    device unless a row asked for logprobs (their top-k reads values on the host)."""
    wants_logprobs = [r.params.logprobs for r in rows]
    adjusted = [i for i, r in enumerate(rows) if _adjusts_logits(r)]
    greedy = [r.params.greedy for r in rows]
    if not adjusted and not any(wants_logprobs):  # the usual step: nothing to do per row
        return _pick(logits, rows, generator, greedy), [None] * len(rows)
    tokens = _pick(_adjusted(logits, rows, adjusted), rows, generator, greedy)
    return tokens, logprobs_of(logits, rows, tokens)


def logprobs_of(
    logits: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor
) -> list[TokenLogprob | None]:
    """The logprob of each row's token, for the rows that asked (from the raw distribution);
    None elsewhere. Reads the tokens on the host only when some row asked."""
    asked = [i for i, r in enumerate(rows) if r.params.logprobs]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if not asked:
        return out
    if len(asked) < len(rows):
        at = _to(logits.device, asked, torch.int64)
        logits, tokens = logits.index_select(0, at), tokens.index_select(0, at)
    raw = torch.log_softmax(logits, dim=-1)
    for i, found in zip(asked, top_logprobs(raw, tokens, [rows[i].params.logprobs for i in asked]), strict=True):
        out[i] = found
    return out


def _adjusted(logits: torch.Tensor, rows: list[SamplingRow], adjusted: list[int]) -> torch.Tensor:
    """The logits with bias, min_tokens' and bad_words' bans, allowed_token_ids and penalties
    applied to the rows listed (a copy when there are any). The masks are -inf, which the
    penalties keep -inf."""
    if not adjusted:
        return logits
    logits = logits.clone()
    _apply_bias_and_min_tokens(logits, rows, adjusted)
    _apply_allowed(logits, rows, adjusted)
    _apply_penalties(logits, rows, adjusted)
    return logits


def distribution(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[N, V] float32: the probabilities each row's token is drawn from when it is not greedy
    (bias, min_tokens, penalties, temperature, top-k, top-p, min-p; a grammar mask the caller
    applied to the logits stays applied)."""
    adjusted = [i for i, r in enumerate(rows) if _adjusts_logits(r)]
    return _filtered_probs(_adjusted(logits.float(), rows, adjusted), rows)


def draw(
    probs: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None
) -> torch.Tensor:
    """[N] int64: one token from each row of probs, with the noise sampling would use (a
    seeded row's generator at its position seed, else generator)."""
    return argmax(probs / _exponential_noise(probs, rows, generator))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1): each row's first largest value's index (a NaN counts as largest). On the
    CPU by torch.max, whose indices are the same (its documented tie rule, and NaN's) and whose
    reduction is vectorised where argmax's is not: 2 cores, 16 x 49,152 float32 logits 0.20
    against 0.59 ms, 64 x 128,256 2.2 against 10.7."""
    return torch.max(x, dim=-1).indices if x.is_cpu else x.argmax(dim=-1)


def _adjusts_logits(row: SamplingRow) -> bool:
    """Whether bias, min_tokens, allowed_token_ids, bad_words or a penalty changes this row's
    logits this step."""
    params = row.params
    return bool(
        params.logit_bias
        or params.allowed_token_ids
        or _banned(row)
        or params.repetition_penalty != 1.0
        or ((params.presence_penalty or params.frequency_penalty) and row.output_token_ids)
    )


def top_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int]) -> list[TokenLogprob]:
    """logprobs [R, V], tokens [R] (int64, on logprobs' device), ks[i] >= 1: row i's token's
    logprob and rank (1 = most likely), with its ks[i] most likely alternatives. A few tensor
    operations and one copy to the host for all rows, not a few per row and value."""
    values = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > values).sum(-1) + 1
    top_v, top_i = logprobs.topk(max(ks), dim=-1)
    host = [x.tolist() for x in (tokens, values.squeeze(1), ranks, top_v, top_i)]
    return [
        TokenLogprob(t, v, r, list(zip(ti[:k], tv[:k], strict=True)))
        for t, v, r, tv, ti, k in zip(*host, ks, strict=True)
    ]


def _apply_bias_and_min_tokens(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    """logit_bias added, then the tokens _banned lists (min_tokens', bad_words') set to -inf,
    on the rows `which` of logits, in place: one indexed add and one indexed write for all of
    them."""
    device = logits.device
    biased = [(i, t, b) for i in which for t, b in rows[i].params.logit_bias.items()]
    if biased:
        at, ids, bias = zip(*biased, strict=True)
        logits.index_put_(
            (_to(device, at, torch.int64), _to(device, ids, torch.int64)),
            _to(device, bias, logits.dtype), accumulate=True,
        )  # fmt: skip
    banned = [(i, t) for i in which for t in sorted(_banned(rows[i]))]
    if banned:
        at, ids = zip(*banned, strict=True)
        logits[_to(device, at, torch.int64), _to(device, ids, torch.int64)] = float("-inf")


def _banned(row: SamplingRow) -> set[int]:
    """The tokens min_tokens and bad_words keep out of this row now."""
    if row.banned is None:
        row.banned = row.params.banned_after(row.output_token_ids, row.eos_token_ids)
    return row.banned


def _apply_allowed(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    """Every logit but those of a row's allowed_token_ids set to -inf, on the rows `which`
    that have them, in place: the allowed logits gathered, the rows filled, the gathered
    written back (one gather, one fill, one scatter for all of them)."""
    limited = [i for i in which if rows[i].params.allowed_token_ids]
    if not limited:
        return
    device = logits.device
    ids = [_allowed_ids(rows[i], device) for i in limited]
    lengths = _to(device, [len(x) for x in ids], torch.int64)
    flat = torch.cat(ids)
    where = _to(device, limited, torch.int64)
    at = torch.repeat_interleave(where, lengths, output_size=len(flat))
    kept = logits[at, flat]
    logits.index_fill_(0, where, float("-inf"))
    logits[at, flat] = kept


def _allowed_ids(row: SamplingRow, device: torch.device) -> torch.Tensor:
    if row.allowed_ids is not None:
        return row.allowed_ids
    return _to(device, row.params.allowed_token_ids, torch.int64)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    """The repetition penalty (HF semantics: over the prompt's and the output's tokens, a
    positive logit divided by it, a negative one multiplied), then the frequency and presence
    penalties (over the output's tokens: its count times one, and the other once), on the
    rows `which` of logits, in place. Each kind gathers, for all its rows at once, the logits
    of the tokens it penalises and writes them back (a token listed twice is written twice
    with the same value): no pass over the vocabulary, no wait for the device."""
    device, vocab = logits.device, logits.shape[1]
    rep = [i for i in which if rows[i].params.repetition_penalty != 1.0]
    if rep:
        prompts = [_prompt_ids(rows[i], device) for i in rep]
        outputs = [rows[i].output_token_ids for i in rep]
        flat = torch.split(_to(device, [t for o in outputs for t in o], torch.int64), [len(o) for o in outputs])
        ids = torch.cat([x for pair in zip(prompts, flat, strict=True) for x in pair])  # row by row
        lengths = _to(device, [len(p) + len(o) for p, o in zip(prompts, outputs, strict=True)], torch.int64)
        at = torch.repeat_interleave(_to(device, rep, torch.int64), lengths, output_size=len(ids))
        penalty = _to(device, [rows[i].params.repetition_penalty for i in rep], logits.dtype)
        p = torch.repeat_interleave(penalty, lengths, output_size=len(ids))
        vals = logits[at, ids]
        logits[at, ids] = torch.where(vals > 0, vals / p, vals * p)
    counted = [
        i for i in which
        if (rows[i].params.presence_penalty or rows[i].params.frequency_penalty) and rows[i].output_token_ids
    ]  # fmt: skip
    if counted:
        outputs = [rows[i].output_token_ids for i in counted]
        ids = _to(device, [t for o in outputs for t in o], torch.int64)
        of_row = _to(device, [j for j, o in enumerate(outputs) for _ in o], torch.int64)
        counts = torch.zeros(len(counted), vocab, dtype=logits.dtype, device=device)
        counts.index_put_((of_row, ids), torch.ones_like(ids, dtype=logits.dtype), accumulate=True)
        at = _to(device, counted, torch.int64)[of_row]
        freq = _to(device, [rows[i].params.frequency_penalty for i in counted], logits.dtype)[of_row]
        pres = _to(device, [rows[i].params.presence_penalty for i in counted], logits.dtype)[of_row]
        logits[at, ids] = logits[at, ids] - freq * counts[of_row, ids] - pres


def _prompt_ids(row: SamplingRow, device: torch.device) -> torch.Tensor:
    if row.prompt_ids is not None:
        return row.prompt_ids
    return _to(device, row.prompt_token_ids, torch.int64)


def _pick(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generator: torch.Generator | None,
    greedy: list[bool],  # per row
) -> torch.Tensor:
    if all(greedy):
        return argmax(logits)
    sampled = draw(_filtered_probs(logits, rows), rows, generator)  # Gumbel-max, exponential form
    if not any(greedy):
        return sampled
    is_greedy = _to(logits.device, greedy, torch.bool)
    return torch.where(is_greedy, argmax(logits), sampled)


def _to(device: torch.device, values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """A small tensor of host values on the device, copied without a stream synchronisation
    (torch.tensor(..., device=cuda) would wait for the forward pass before it)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


# On the CPU, rows that filter first try the PREFIX most likely tokens (torch.topk) instead of
# sorting the whole vocabulary: 16 x 49,152 logits, 2 cores: sort 24 ms, topk(1024) 3.2 ms.
PREFIX = 1024


def _filters(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min-p can drop a token of this row."""
    return 0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0


def _filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as probabilities: [N, V]. Rows that filter
    nothing are a softmax; the others keep, in order of probability, the top_k most likely
    tokens, of those the smallest set whose mass reaches top_p (the mass renormalised after
    top-k), and of those the tokens of at least min_p times the most likely one's
    probability (the most likely always survives)."""
    dtype, device = logits.dtype, logits.device
    temps = _to(device, [1.0 if r.params.greedy else r.params.temperature for r in rows], dtype)
    logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[1]
    filtering = [i for i, r in enumerate(rows) if _filters(r.params, vocab)]
    if not filtering:
        return logits.softmax(dim=-1)
    every = len(filtering) == len(rows)
    at = _to(device, filtering, torch.int64)
    some = [rows[i].params for i in filtering]
    top_k = [min(p.top_k or vocab, vocab) for p in some]
    top_p, min_p = [p.top_p for p in some], [p.min_p for p in some]
    sub = logits if every else logits.index_select(0, at)
    lse = sub.logsumexp(dim=-1)
    ranked: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (rows of sub, sorted, ids)
    rest = list(range(len(filtering)))
    if device.type == "cpu":  # (its host checks cost no device synchronisation here)
        prefix, rest = _prefix_rows(sub, lse, top_k, top_p, min_p)
        ranked += prefix
    if rest:
        part = sub if len(rest) == len(filtering) else sub[rest]
        ranked.append((rest, *part.sort(dim=-1, descending=True)))
    filtered = torch.full_like(sub, float("-inf"))
    for where, values, order in ranked:
        index = _to(device, where, torch.int64)
        kept = _filter_sorted(
            values, lse.index_select(0, index), [top_k[i] for i in where],
            [top_p[i] for i in where], [min_p[i] for i in where], vocab,
        )  # fmt: skip
        part = torch.full((len(where), vocab), float("-inf"), dtype=dtype, device=device)
        filtered.index_copy_(0, index, part.scatter(1, order, kept))
    if every:
        return filtered.softmax(dim=-1)
    return logits.softmax(dim=-1).index_copy(0, at, filtered.softmax(dim=-1))


def _filter_sorted(
    sorted_logits: torch.Tensor,
    full_lse: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    vocab: int,
) -> torch.Tensor:
    """The most likely K >= max(top_k) logits of each row, in descending order, with the
    dropped ones set to -inf. full_lse: each row's logsumexp over all its logits, the
    normaliser of rows that keep all their tokens through top-k."""
    device, width = sorted_logits.device, sorted_logits.shape[1]
    k = _to(device, top_k, torch.int64).unsqueeze(1)
    drop = torch.arange(width, device=device).unsqueeze(0) >= k
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    # renormalised after top-k: over the kept prefix, or the whole row where top-k keeps all
    keeps_all = _to(device, [t >= vocab for t in top_k], torch.bool).unsqueeze(1)
    norm = torch.where(keeps_all, full_lse.unsqueeze(1), masked.logsumexp(dim=-1, keepdim=True))
    sorted_probs = (masked - norm).exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    p = _to(device, top_p, sorted_probs.dtype).unsqueeze(1)
    drop |= (mass_before >= p) & (p < 1.0)  # keeps the smallest set reaching top_p
    drop |= sorted_probs < _to(device, min_p, sorted_probs.dtype).unsqueeze(1) * sorted_probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return masked.masked_fill(drop, float("-inf"))


def _prefix_rows(
    sub: torch.Tensor, lse: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> tuple[list[tuple[list[int], torch.Tensor, torch.Tensor]], list[int]]:
    """The rows whose kept tokens all lie among their PREFIX (or max top_k) most likely ones,
    with those logits sorted and their ids, and the other rows. A token past the prefix is
    dropped by top_k, by top_p (the prefix's mass reaches it) or by min_p (the prefix's last
    token is already below it); a row with none of these, or a prefix as wide as the
    vocabulary, is sorted whole."""
    vocab = sub.shape[1]
    width = max([PREFIX] + [t for t in top_k if t < vocab])
    if width >= vocab:
        return [], list(range(len(top_k)))
    values, order = sub.topk(width, dim=-1)
    probs = (values - lse.unsqueeze(1)).exp()
    mass, last, first = probs.sum(dim=-1).tolist(), probs[:, -1].tolist(), probs[:, 0].tolist()
    fits = [
        k < vocab or mass[i] >= top_p[i] or last[i] < min_p[i] * first[i] for i, k in enumerate(top_k)
    ]
    where = [i for i, ok in enumerate(fits) if ok]
    rest = [i for i, ok in enumerate(fits) if not ok]
    if not where:
        return [], rest
    if rest:
        values, order = values[where], order[where]
    return [(where, values, order)], rest


def _exponential_noise(
    probs: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None
) -> torch.Tensor:
    """Exp(1) noise, [N, V]: a seeded row's from its own generator."""
    noise = _exponential(probs.shape, probs, generator)
    for i, row in enumerate(rows):
        if row.generator is not None:
            if row.position_seed is not None:
                row.generator.manual_seed(row.position_seed)
            noise[i] = _exponential(probs.shape[1:], probs, row.generator)
    return noise


def _exponential(shape: torch.Size, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) samples on like's device and dtype. On the CPU as -log(U), U uniform in [0, 1)
    (U = 0 gives +inf: that token loses the draw): exponential_() draws one element at a
    time there, 11.8 ms for 16 x 49,152 against 1.5 for torch.rand (2 cores)."""
    if like.device.type != "cpu":
        return torch.empty(shape, dtype=like.dtype, device=like.device).exponential_(generator=generator)
    return torch.rand(shape, dtype=like.dtype, generator=generator).log_().neg_()


def position_seed(seed: int, position: int) -> int:
    """A generator seed for one output position of a request with a seed."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def verify_on_device(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[int | None],
    generator: torch.Generator | None = None,
    draft_probs: tuple[list[int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[TokenLogprob | None]]:
    """Speculative decoding's check of guessed tokens, one row per position. Row i holds the
    target's logits after the tokens before it (rows[i]'s output_token_ids count the guesses
    before it); drafts[i] is the guess for the token it predicts (None: no guess). Returns
    ([N] tokens, [N] bool accepted, logprobs) with the tokens on the device: at a row whose
    guess is refused, tokens holds the token emitted instead.

    A guess that was chosen, not drawn (prompt lookup, suffix, grammar, a greedy or seeded
    draft model): each row is sampled exactly as without guesses (sample_on_device: bias,
    penalties, temperature, top-k, top-p, min-p, the grammar mask the caller applied, and a
    seeded request's noise drawn for its output position), and the guess is accepted when it
    is the token its row drew. The emitted tokens are the tokens sampling would have drawn
    one step at a time, so the distribution is unchanged and a seeded request's output is
    the same with or without speculation. This is rejection sampling against a proposal that
    puts all its mass on the guess: accepted with probability p(g).

    draft_probs (rows, q [len(rows), V]): guesses drawn from a draft model's distribution q.
    Those rows use rejection sampling (Leviathan et al., Chen et al.): with p the target's
    distribution after all of the above, g is accepted with probability min(1, p(g) / q(g)),
    and a refused row emits a token drawn from max(0, p - q), normalised. Either way each
    emitted token has the target's distribution p (a greedy row is never listed here)."""
    tokens, logprobs = sample_on_device(logits, rows, generator)
    guess = _to(logits.device, [0 if d is None else d for d in drafts], torch.int64)
    has_guess = _to(logits.device, [d is not None for d in drafts], torch.bool)
    accepted = has_guess & (tokens == guess)
    if draft_probs is None or not draft_probs[0]:
        return tokens, accepted, logprobs
    index, q = draft_probs
    drawn = [rows[i] for i in index]
    at = _to(logits.device, index, torch.int64)
    p = distribution(logits[at], drawn)
    g = guess[at].unsqueeze(1)
    p_g, q_g = p.gather(1, g).squeeze(1), q.gather(1, g).squeeze(1)
    u = torch.rand(p_g.shape, device=p.device, generator=generator, dtype=p.dtype)
    keep = u * q_g < p_g  # (p(g) = 0: never; q(g) = 0 cannot be drawn)
    residual = (p - q).clamp_min(0)
    empty = residual.sum(dim=1, keepdim=True) <= 0  # p <= q everywhere: p == q
    residual = torch.where(empty, p, residual)  # (draw normalises: argmax of r / noise)
    instead = draw(residual, drawn, generator)
    tokens = tokens.clone()
    tokens[at] = torch.where(keep, guess[at], instead)
    accepted = accepted.clone()
    accepted[at] = keep
    lp = logprobs_of(logits[at], drawn, tokens[at])
    logprobs = list(logprobs)
    for i, one in zip(index, lp, strict=True):
        logprobs[i] = one
    return tokens, accepted, logprobs
