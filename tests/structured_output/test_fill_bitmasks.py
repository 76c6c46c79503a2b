"""Batched bitmask filling (`fill_bitmasks`) against the serial fill, and the bitmask kernel."""

from __future__ import annotations

import importlib.util
import json
import random
from typing import Any

import pytest
import torch
import xgrammar as xgr

from mmserve.kernels import cpu_layers
from mmserve.structured_output import (
    GrammarMatcher,
    StructuredOutputParams,
    allocate_bitmask,
    apply_bitmask,
)
from mmserve.structured_output.backend import (
    _apply_with_torch,
    _device_kernel,
    default_fill_threads,
    fill_bitmasks,
)
from mmserve.structured_output.xgrammar_backend import XGrammarMatcher
from tests.kernels.test_cpu_layers import bitmask_case, masked_by_bits
from tests.structured_output.conftest import PADDED_VOCAB, SMOLLM2_EOS, get_backend
from tests.structured_output.walk import Vocab, walk

PARAMS = [
    StructuredOutputParams(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
                    "n": {"type": "integer"},
                },
                "required": ["name", "n"],
                "additionalProperties": False,
            }
        ),
    ),
    StructuredOutputParams("regex", r"[a-z]{2,6}(-[0-9]{1,3}){1,3}"),
    StructuredOutputParams("choice", ["yes", "no", "maybe not"]),
    StructuredOutputParams("json_object", ""),
]
EBNF = StructuredOutputParams("grammar", 'root ::= "(" root ")" | "x"')  # xgrammar only


def random_states(tokenizer: Any, vocab: Vocab, backend_name: str, n: int) -> list[GrammarMatcher]:
    """n matchers of the backend, each some way into a random walk; some terminated."""
    backend = get_backend(tokenizer, backend_name)
    params = PARAMS + ([EBNF] if backend_name == "xgrammar" else [])
    compiled = [backend.compile(p) for p in params]
    walks = [(c, walk(c.matcher(), vocab, seed)) for seed, c in enumerate(compiled)]
    rng = random.Random(backend_name)
    matchers = []
    for _ in range(n):
        grammar, tokens = rng.choice(walks)
        matcher = grammar.matcher()
        ended = rng.random() < 0.2
        for token in tokens if ended else tokens[: rng.randrange(len(tokens) + 1)]:
            assert matcher.accept_token(token)
        if ended:
            assert matcher.accept_token(SMOLLM2_EOS[0]) and matcher.is_terminated()
        matchers.append(matcher)
    return matchers


def serial_and_batched(
    matchers: list[GrammarMatcher], rows: list[int], batch: int, threads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    start = allocate_bitmask(batch, PADDED_VOCAB)
    start.random_(generator=gen)  # rows left out must stay as they were
    serial, batched = start.clone(), start.clone()
    for matcher, row in zip(matchers, rows):
        matcher.fill_bitmask(serial, row)
    fill_bitmasks(matchers, batched, rows, threads)
    return serial, batched


@pytest.mark.parametrize("threads", [1, 3])
def test_batched_fill_equals_serial(
    tokenizer: Any, vocab: Vocab, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    matchers = random_states(tokenizer, vocab, "xgrammar", 24)
    rows = random.Random(threads).sample(range(32), len(matchers))  # scattered, unordered
    serial = allocate_bitmask(32, PADDED_VOCAB)
    for matcher, row in zip(matchers, rows):
        matcher.fill_bitmask(serial, row)
    calls = []
    batch_fill = xgr.BatchGrammarMatcher.batch_fill_next_token_bitmask

    def counted(self: xgr.BatchGrammarMatcher, *args: Any) -> None:
        calls.append(args)
        batch_fill(self, *args)

    monkeypatch.setattr(XGrammarMatcher, "fill_bitmask", None)  # the batched path only
    monkeypatch.setattr(xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask", counted)
    batched = allocate_bitmask(32, PADDED_VOCAB)
    fill_bitmasks(matchers, batched, rows, threads)
    assert len(calls) == 1
    assert torch.equal(serial, batched)


def test_mixed_backends_equal_serial(tokenizer: Any, vocab: Vocab) -> None:
    xgr = random_states(tokenizer, vocab, "xgrammar", 6)
    outlines = random_states(tokenizer, vocab, "outlines", 6)
    matchers = [m for pair in zip(xgr, outlines) for m in pair]  # interleaved
    rows = list(range(1, 2 * len(matchers), 2))
    serial, batched = serial_and_batched(matchers, rows, 2 * len(matchers) + 1, 2)
    assert torch.equal(serial, batched)


def test_fill_does_not_change_the_state(tokenizer: Any) -> None:
    grammar = get_backend(tokenizer, "xgrammar").compile(PARAMS[2])
    matchers = [grammar.matcher() for _ in range(3)]
    fill_bitmasks(matchers, allocate_bitmask(3, PADDED_VOCAB), [0, 1, 2])
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert all(m.accept_token(yes[0]) for m in matchers)


def test_fill_bitmasks_checks_rows_and_width(tokenizer: Any) -> None:
    grammar = get_backend(tokenizer, "xgrammar").compile(PARAMS[1])
    a, b = grammar.matcher(), grammar.matcher()
    bitmask = allocate_bitmask(2, PADDED_VOCAB)
    with pytest.raises(ValueError, match="distinct"):
        fill_bitmasks([a, b], bitmask, [1, 1])
    with pytest.raises(ValueError, match="distinct"):
        fill_bitmasks([a], bitmask, [2])
    with pytest.raises(ValueError, match="2 matchers for 1 rows"):
        fill_bitmasks([a, b], bitmask, [0])
    with pytest.raises(ValueError, match="width"):
        fill_bitmasks([a, b], allocate_bitmask(2, PADDED_VOCAB + 32), [0, 1])
    fill_bitmasks([], bitmask, [])  # nothing to do


def test_default_threads_leave_cpus_free() -> None:
    assert 1 <= default_fill_threads() <= 8


def random_logits_and_bitmask(batch: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(batch, vocab, generator=gen)
    width = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, width), dtype=torch.int32, generator=gen)
    return logits, bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cpu_masking_follows_the_bits(dtype: torch.dtype) -> None:
    """apply_bitmask on CPU logits (xgrammar's C++ kernel where installed, float64 through
    the torch code), with the C library's kernel that the runner passes for float32, and
    the torch code itself: each masks exactly the listed rows' tokens whose bits are clear,
    vocab 1000 leaving the last word's padding."""
    logits, bitmask, rows = bitmask_case(1000)
    logits = logits.to(dtype)
    expected = masked_by_bits(logits, bitmask, rows)
    ours = logits.clone()
    apply_bitmask(ours, bitmask, rows)
    assert torch.equal(ours, expected)
    by_torch = logits.clone()
    _apply_with_torch(by_torch, bitmask, 1000, rows)
    assert torch.equal(by_torch, expected)
    if cpu_layers.supports(logits):
        by_library = logits.clone()
        apply_bitmask(by_library, bitmask, rows, cpu_layers.apply_bitmask_cpu)
        assert torch.equal(by_library, expected)


def test_cpu_logits_take_xgrammars_kernel() -> None:
    pytest.importorskip("xgrammar")
    assert _device_kernel("cpu") is not None
    assert _device_kernel("mps") is None


def test_the_runner_masks_float32_cpu_logits_with_the_library(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from mmserve.runner import model_runner

    if not cpu_layers.supports(torch.zeros(1)):
        pytest.skip("the CPU library does not build here")
    calls: list[int] = []
    real = cpu_layers.apply_bitmask_cpu
    monkeypatch.setattr(cpu_layers, "apply_bitmask_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits, bitmask, rows = bitmask_case(1000)
    expected = masked_by_bits(logits, bitmask, rows)
    model_runner._mask(logits, (bitmask, rows), None)
    assert calls == [1] and torch.equal(logits, expected)


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("xgrammar", "triton")),
    reason="xgrammar's Triton kernel needs both packages",
)
def test_cuda_uses_the_xgrammar_kernel() -> None:
    assert _device_kernel("cuda") is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_equals_the_cpu_path(dtype: torch.dtype) -> None:
    logits, bitmask = random_logits_and_bitmask(8, 128_256)
    logits = logits.to(dtype)
    expected = logits.clone()
    apply_bitmask(expected, bitmask, [1, 7, 3])
    on_gpu = logits.cuda()
    apply_bitmask(on_gpu, bitmask.pin_memory(), [1, 7, 3])
    assert torch.equal(on_gpu.cpu(), expected)


@pytest.mark.parametrize("backend_name", ["xgrammar"])  # the others accept one at a time
def test_batched_accept_equals_one_by_one(tokenizer: Any, vocab: Vocab, backend_name: str) -> None:
    from mmserve.structured_output.backend import accept_tokens, unpack_bitmask

    one = random_states(tokenizer, vocab, backend_name, 24)
    many = random_states(tokenizer, vocab, backend_name, 24)  # the same states, rebuilt
    rng = random.Random(7)
    tokens = [rng.randrange(vocab.size) for _ in one]  # mostly refused, some accepted
    width = allocate_bitmask(1, PADDED_VOCAB)
    for i, matcher in enumerate(one):  # an allowed token for every third matcher
        if i % 3 == 0 and not matcher.is_terminated():
            matcher.fill_bitmask(width, 0)
            allowed = unpack_bitmask(width, vocab.size)[0].nonzero().flatten().tolist()
            tokens[i] = allowed[0] if allowed else tokens[i]
    want = [m.accept_token(t) for m, t in zip(one, tokens)]
    assert accept_tokens(many, tokens) == want and any(want) and not all(want)
    a, b = allocate_bitmask(len(one), PADDED_VOCAB), allocate_bitmask(len(one), PADDED_VOCAB)
    fill_bitmasks(one, a, list(range(len(one))), 1)
    fill_bitmasks(many, b, list(range(len(one))), 1)
    assert torch.equal(a, b)  # the states moved alike


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines"])
def test_fill_overwrites_whole_rows(tokenizer: Any, vocab: Vocab, backend_name: str) -> None:
    """The runner reuses its bitmask buffers without resetting them: a filled row must not
    depend on what the row held before (terminated matchers included)."""
    matchers = random_states(tokenizer, vocab, backend_name, 12)
    assert any(m.is_terminated() for m in matchers)
    rows = list(range(len(matchers)))
    clean = allocate_bitmask(len(matchers), PADDED_VOCAB)
    fill_bitmasks(matchers, clean, rows, 2)
    for fill in (0, -1, 0x5A5A5A5A):
        dirty = torch.full_like(clean, fill)
        fill_bitmasks(matchers, dirty, rows, 2)
        assert torch.equal(dirty, clean)
