"""Constrained output stays valid UTF-8: no UTF-16 surrogate's three bytes (ED A0-BF xx), which
xgrammar's JSON strings and character classes let through and which decode to U+FFFD."""

from __future__ import annotations

from typing import Any

import pytest

from mmserve.structured_output import (
    StructuredOutputParams,
    allocate_bitmask,
    fill_bitmasks,
    unpack_bitmask,
)
from mmserve.structured_output.backend import accept_tokens
from mmserve.structured_output.xgrammar_backend import _Utf8Guard
from tests.structured_output.conftest import PADDED_VOCAB, get_backend
from tests.structured_output.walk import Vocab

PARAMS = [StructuredOutputParams("json_schema", '{"type": "string", "maxLength": 8}'),
          StructuredOutputParams("regex", "[^a]{1,8}"), StructuredOutputParams("json_object")]


def _byte_token(vocab: Vocab, value: int) -> int:
    return next(i for i, b in enumerate(vocab.table) if b == bytes([value]))


@pytest.mark.parametrize("params", PARAMS, ids=["json_schema", "regex", "json_object"])
def test_a_lead_ed_is_followed_only_by_80_to_9f(backend: Any, vocab: Vocab, tokenizer: Any,
                                               params: StructuredOutputParams) -> None:
    matcher = backend.compile(params).matcher()
    prefix = {"json_schema": '"', "regex": "", "json_object": '{"k": "'}[params.kind]
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        assert matcher.accept_token(token)
    ed = _byte_token(vocab, 0xED)
    assert matcher.accept_token(ed)
    for fill in ("one", "batch"):
        bitmask = allocate_bitmask(2, PADDED_VOCAB)
        if fill == "one":
            matcher.fill_bitmask(bitmask, 1)
        else:
            fill_bitmasks([matcher], bitmask, [1])
        allowed = unpack_bitmask(bitmask, PADDED_VOCAB)[1]
        firsts = {b[0] for i, b in enumerate(vocab.table) if b and allowed[i]}
        assert firsts and firsts <= set(range(0x80, 0xA0)), (fill, sorted(hex(f) for f in firsts))
    assert not matcher.accept_token(_byte_token(vocab, 0xA0))
    assert matcher.accept_token(_byte_token(vocab, 0x9F))
    matcher.rollback(2)  # back before the lead: a surrogate's continuation is no longer next
    assert matcher.accept_token(_byte_token(vocab, 0xED))
    assert not matcher.accept_token(_byte_token(vocab, 0xBF))


def test_batched_accepts_refuse_a_surrogates_continuation(vocab: Vocab, tokenizer: Any) -> None:
    """accept_tokens (the engine's batched path) refuses what accept_token refuses."""
    compiled = get_backend(tokenizer, "xgrammar").compile(PARAMS[1])
    matchers = [compiled.matcher(), compiled.matcher()]
    assert accept_tokens(matchers, [_byte_token(vocab, 0xED)] * 2) == [True, True]
    assert accept_tokens(matchers, [_byte_token(vocab, 0xA5), _byte_token(vocab, 0x85)]) == [False, True]
    assert accept_tokens(matchers, [_byte_token(vocab, 0x85), _byte_token(vocab, 0x85)]) == [True, True]


def test_guard_forbids_tokens_holding_a_whole_surrogate() -> None:
    """A vocabulary with a token that holds ED A0-BF itself (none learnt from UTF-8 text has
    one): that token is never allowed; one that ends with ED makes A0-BF first bytes wait."""
    decoded = [b"a", b"x\xed\xa0\x80", b"\xed", b"\xa0", b"\x9f", b"\xed\x9f", b"", b"b\xed"] + [b"c"] * 30
    guard = _Utf8Guard(decoded, len(decoded))
    assert guard.never == {1} and guard.after_lead == {1, 3} and guard.ends_lead == {2, 7}
    bitmask = allocate_bitmask(3, len(decoded))
    guard.narrow(bitmask, [0, 2], [False, True])
    allowed = unpack_bitmask(bitmask, len(decoded))
    assert allowed[1].all()  # untouched
    assert allowed[0].tolist() == [i != 1 for i in range(len(decoded))]
    assert allowed[2].tolist() == [i not in (1, 3) for i in range(len(decoded))]
    assert guard.forbids(1, False) and guard.forbids(3, True) and not guard.forbids(3, False)
