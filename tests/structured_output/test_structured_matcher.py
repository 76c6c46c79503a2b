"""Matchers and bitmasks: padded vocabularies, special tokens, rollback, termination."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mmserve.structured_output import (
    StructuredOutputBackend,
    StructuredOutputParams,
    allocate_bitmask,
    apply_bitmask,
    unpack_bitmask,
)
from mmserve.structured_output.vocab import special_token_ids
from tests.structured_output.conftest import PADDED_VOCAB, SMOLLM2_EOS, SMOLLM2_VOCAB, get_backend
from tests.structured_output.walk import Vocab, walk


def test_apply_bitmask_masks_only_constrained_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 70, 4  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(batch, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, 3), dtype=torch.int32, generator=gen)
    before = logits.clone()
    apply_bitmask(logits, bitmask, [1, 3])
    allowed = unpack_bitmask(bitmask, vocab)
    for row in range(batch):
        if row in (1, 3):
            assert torch.equal(logits[row][allowed[row]], before[row][allowed[row]])
            assert torch.isneginf(logits[row][~allowed[row]]).all()
        else:
            assert torch.equal(logits[row], before[row])
    for token in range(vocab):  # bit j of word i is token 32 * i + j
        assert allowed[1, token] == bool((int(bitmask[1, token // 32]) >> (token % 32)) & 1)


def test_apply_bitmask_checks_width() -> None:
    with pytest.raises(ValueError, match="covers 32 tokens"):
        apply_bitmask(torch.zeros(1, 40), allocate_bitmask(1, 32), [0])
    apply_bitmask(torch.zeros(1, 40), allocate_bitmask(1, 40), [])  # nothing to do


def allowed_after(
    backend: StructuredOutputBackend, params: StructuredOutputParams, tokenizer: Any, prefix: str
) -> torch.Tensor:
    matcher = backend.compile(params).matcher()
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        assert matcher.accept_token(token)
    bitmask = allocate_bitmask(2, PADDED_VOCAB)
    matcher.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all()  # other rows untouched
    return unpack_bitmask(bitmask, PADDED_VOCAB)[1]


def test_padding_and_special_tokens_never_allowed(
    backend: StructuredOutputBackend, tokenizer: Any
) -> None:
    # Inside a free string almost every token is allowed: not padding, not specials.
    params = StructuredOutputParams("json_schema", '{"type": "string"}')
    allowed = allowed_after(backend, params, tokenizer, '"abc')
    assert allowed.sum() > 40_000
    assert not allowed[SMOLLM2_VOCAB:].any()
    specials = sorted(special_token_ids(tokenizer))
    assert specials and not allowed[specials].any()


def test_only_stop_tokens_once_complete(backend: StructuredOutputBackend, tokenizer: Any) -> None:
    params = StructuredOutputParams("choice", ["yes", "no"])
    allowed = allowed_after(backend, params, tokenizer, "yes")
    assert allowed.nonzero().flatten().tolist() == list(SMOLLM2_EOS)


def test_accept_rollback_terminate_reset(backend: StructuredOutputBackend, tokenizer: Any) -> None:
    params = StructuredOutputParams("regex", "(ab|cd)+")
    matcher = backend.compile(params).matcher()
    ab, cd, x = (tokenizer.encode(t, add_special_tokens=False) for t in ("ab", "cd", "x"))
    assert len(ab) == len(cd) == len(x) == 1
    assert not matcher.accept_token(SMOLLM2_EOS[0])  # nothing generated yet
    assert matcher.accept_token(ab[0]) and not matcher.accept_token(x[0])
    assert matcher.accept_token(cd[0]) and matcher.accept_token(SMOLLM2_EOS[0])
    assert matcher.is_terminated() and not matcher.accept_token(ab[0])
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    matcher.fill_bitmask(bitmask, 0)  # harmless after the end: only stop tokens
    assert unpack_bitmask(bitmask, PADDED_VOCAB)[0].nonzero().flatten().tolist() == [2]
    with pytest.raises(ValueError):
        matcher.rollback(4)  # only 3 tokens were accepted
    matcher.rollback(2)  # the stop token and "cd"
    assert not matcher.is_terminated()
    assert matcher.accept_token(ab[0]) and matcher.accept_token(SMOLLM2_EOS[0])
    matcher.reset()
    assert not matcher.is_terminated() and not matcher.accept_token(SMOLLM2_EOS[0])
    assert matcher.accept_token(cd[0])
    matcher.fill_bitmask(bitmask, 0)  # complete but may go on: "ab", "cd" and stop
    allowed = unpack_bitmask(bitmask, PADDED_VOCAB)[0]
    assert allowed[[ab[0], cd[0], SMOLLM2_EOS[0]]].all() and not allowed[x[0]]


def test_backends_allow_the_same_tokens(tokenizer: Any, vocab: Vocab) -> None:
    """Two engines, one vocabulary: step by step they must agree on what is allowed."""
    params = StructuredOutputParams("regex", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)")
    xgrammar = get_backend(tokenizer, "xgrammar").compile(params)
    outlines = get_backend(tokenizer, "outlines").compile(params)
    for seed in range(3):
        tokens = walk(xgrammar.matcher(), vocab, seed)
        matchers = [xgrammar.matcher(), outlines.matcher()]
        bitmask = allocate_bitmask(2, PADDED_VOCAB)
        for token in [*tokens, SMOLLM2_EOS[0]]:
            for row, matcher in enumerate(matchers):
                matcher.fill_bitmask(bitmask, row)
            assert torch.equal(bitmask[0], bitmask[1])
            assert all(m.accept_token(token) for m in matchers)
