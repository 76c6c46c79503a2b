"""Matchers and bitmasks: padded vocabularies, special tokens, rollback, termination."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import jsonschema
import pytest
import torch

from mmserve.structured_output import (
    GrammarMatcher,
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


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputParams("regex", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"),
        StructuredOutputParams("regex", r"0(\.0)?|[1-9][0-9]{0,3}"),
        StructuredOutputParams("choice", ["a", "ab", "abc"]),
        StructuredOutputParams("json_schema", json.dumps({"enum": [0, 5, 50, 500]})),
    ],
    ids=["email", "number", "choice", "enum"],
)
def test_backends_allow_the_same_tokens(
    tokenizer: Any, vocab: Vocab, params: StructuredOutputParams
) -> None:
    """Two engines, one vocabulary: step by step they must agree on what is allowed."""
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


def fullmatch(pattern: str) -> Callable[[str], bool]:
    return lambda text: re.fullmatch(pattern, text) is not None


def validates(schema: Any) -> Callable[[str], bool]:
    validator = jsonschema.Draft202012Validator(schema)

    def check(text: str) -> bool:
        if text != text.strip():  # json.loads takes surrounding whitespace, the grammars don't
            return False
        try:
            return validator.is_valid(json.loads(text))
        except ValueError:
            return False

    return check


PRETTY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["name", "tags"],
}
# (params, a valid output, the reference: which texts are whole outputs). Each output passes
# a point where a shorter output is already whole (outlines-core 0.2.14 cut those: its Index
# dropped tokens ending past a match), or has whitespace that pretty-printed JSON has.
ENDS_CASES = [
    pytest.param(
        StructuredOutputParams("regex", r"0(\.0)?"), "0.0", fullmatch(r"0(\.0)?"), id="regex"
    ),
    pytest.param(
        StructuredOutputParams("choice", ["a", "ab"]),
        "ab",
        lambda text: text in ("a", "ab"),
        id="choice",
    ),
    pytest.param(
        StructuredOutputParams("json_schema", json.dumps({"enum": [0, 5, 50]})),
        "50",
        validates({"enum": [0, 5, 50]}),
        id="enum",
    ),
    pytest.param(
        StructuredOutputParams("regex", "a.*"), "a café 😀", fullmatch("a.*"), id="unicode"
    ),
    pytest.param(
        StructuredOutputParams("json_schema", json.dumps(PRETTY_SCHEMA)),
        json.dumps({"name": "x y", "tags": [1, 20]}, indent=2),
        validates(PRETTY_SCHEMA),
        id="pretty-json",
    ),
]


def assert_ends_where_valid(
    matcher: GrammarMatcher,
    tokens: Sequence[int],
    table: Sequence[bytes | None],
    is_whole: Callable[[str], bool],
) -> None:
    """Each token is allowed and accepted; a stop token is allowed exactly where the text so
    far is a whole output (`is_whole` of it, as UTF-8)."""
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    text = b""
    for token in [*tokens, None]:
        matcher.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, PADDED_VOCAB)[0]
        try:
            whole = is_whole(text.decode())
        except UnicodeDecodeError:  # a character cut between tokens
            whole = False
        assert bool(allowed[SMOLLM2_EOS[0]]) == whole, text
        if token is None:
            break
        assert allowed[token] and matcher.accept_token(token), (text, table[token])
        text += cast(bytes, table[token])
    assert matcher.accept_token(SMOLLM2_EOS[0]) and matcher.is_terminated()


@pytest.mark.parametrize("tokens_of", ["tokenizer", "bytes"])
@pytest.mark.parametrize(("params", "output", "is_whole"), ENDS_CASES)
def test_output_may_go_on_where_it_could_end(
    backend: StructuredOutputBackend,
    tokenizer: Any,
    vocab: Vocab,
    tokens_of: str,
    params: StructuredOutputParams,
    output: str,
    is_whole: Callable[[str], bool],
) -> None:
    """Walked as the tokenizer splits it, and one byte-level token per byte (so every byte
    boundary is a candidate end)."""
    assert is_whole(output)
    if tokens_of == "tokenizer":
        tokens = tokenizer.encode(output, add_special_tokens=False)
    else:
        byte_token = {data[0]: i for i, data in enumerate(vocab.table) if data and len(data) == 1}
        tokens = [byte_token[b] for b in output.encode()]
    matcher = backend.compile(params).matcher()
    assert_ends_where_valid(matcher, tokens, vocab.table, is_whole)
