"""The CPU library's layer operations (mmserve/kernels/cpu_layers.py, cpu/layer_ops.c) against
the torch path they replace, on random inputs of odd sizes: rotary embedding and the KV cache
write bit-equal, RMSNorm (with and without the residual add, rows apart, decode- and
prefill-sized so both the one-thread and the threaded loops run) and SiLU-and-mul (its exp a
polynomial, over the whole range where silu bends and saturates) within float32 rounding; and
a model's layers take them where they apply, the torch path elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve.kernels import cpu_layers, cpu_lib
from mmserve.kernels.paged_ref import write_kv_cache
from mmserve.models.layers import RMSNorm, Rope, apply_rotary, silu_and_mul
from tests.kernels.test_cpu_gguf import BUILDS, _has

pytestmark = pytest.mark.skipif(not cpu_lib.available(), reason="the CPU library does not build here")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (16, 576), (7, 100), (2048, 72)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_the_torch_path(rows: int, dim: int, with_residual: bool) -> None:
    gen = _gen(rows + dim)
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = torch.randn(dim, generator=gen)
    wide = torch.randn(rows, dim + 8, generator=gen) * 30
    x = wide[:, 3 : 3 + dim]  # rows apart
    residual = torch.randn(rows, dim, generator=gen) if with_residual else None
    total = x + residual if residual is not None else x
    expected = norm._norm(total)  # the torch composite transformers computes
    out, summed = cpu_layers.rms_norm_cpu(x, residual, norm.weight, norm.eps)
    assert torch.equal(summed, total)
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    got = norm(x, residual) if residual is not None else (norm(x), x)
    assert torch.equal(got[0], out) and torch.equal(got[1], summed)  # the module takes it


@pytest.mark.parametrize(("tokens", "heads", "dim"), [(1, 9, 64), (16, 3, 64), (5, 2, 10), (300, 4, 128)])
def test_rotary_is_bit_equal(tokens: int, heads: int, dim: int) -> None:
    gen = _gen(tokens * dim)
    qkv = torch.randn(tokens, (heads + 1) * dim, generator=gen)
    x = qkv[:, :heads * dim].view(tokens, heads, dim)  # a view of a wider row, as in a layer
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    assert torch.equal(cpu_layers.rotary_cpu(x, cos, sin), apply_rotary(x, cos, sin))
    k = qkv[:, heads * dim :].view(tokens, 1, dim)
    q_got, k_got = Rope(cos, sin, None).apply(x, k)  # the CPU path of every model's rotary
    assert torch.equal(q_got, apply_rotary(x, cos, sin)) and torch.equal(k_got, apply_rotary(k, cos, sin))


@pytest.mark.parametrize("shape", [(1, 2, 16), (16, 3072), (5, 70), (300, 2, 1536)])
def test_silu_and_mul_equals_torchs(shape: tuple[int, ...]) -> None:
    gen = _gen(sum(shape))
    wide = torch.randn(*shape[:-1], shape[-1] + 6, generator=gen) * 12  # (rows apart)
    edges = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e-30, -1e-30, 200.0, -200.0])  # 0s, saturation, tiny
    wide.view(-1, wide.shape[-1])[0, : min(8, shape[-1] // 2)] = edges[: shape[-1] // 2]
    gate_up = wide[..., : shape[-1]]
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = cpu_layers.silu_and_mul_cpu(gate_up)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(silu_and_mul(gate_up), expected, rtol=2e-6, atol=1e-6)  # the model's


def test_the_cache_write_is_bit_equal_and_checks_its_slots() -> None:
    gen = _gen(3)
    tokens, kv_heads, dim = 11, 3, 24
    qkv = torch.randn(tokens, 2 * kv_heads * dim + 5, generator=gen)
    k = qkv[:, : kv_heads * dim].view(tokens, kv_heads, dim)
    v = qkv[:, kv_heads * dim : 2 * kv_heads * dim].view(tokens, kv_heads, dim)
    slots = torch.randperm(5 * 8, generator=gen)[:tokens]
    slots[[2, 7]] = -1  # skipped
    ours, theirs = torch.randn(2, 5, 8, kv_heads, dim, generator=gen), None
    theirs = ours.clone()
    cpu_layers.write_kv_cpu(k, v, ours, slots)
    write_kv_cache(k, v, theirs, slots)
    assert torch.equal(ours, theirs)
    before = ours.clone()
    with pytest.raises(ValueError, match="past the cache's 40"):
        cpu_layers.write_kv_cpu(k, v, ours, torch.tensor([0] * (tokens - 1) + [40]))
    assert torch.equal(ours, before)  # nothing written


def test_only_float32_cpu_tensors() -> None:
    x = torch.randn(2, 8)
    assert cpu_layers.supports(x, x)
    assert not cpu_layers.supports(x, x.bfloat16())
    norm = RMSNorm(8, 1e-5).bfloat16()
    out = norm(x.bfloat16())  # the torch path, as transformers rounds bfloat16
    assert out.dtype == torch.bfloat16


def masked_by_bits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A grammar bitmask's meaning written out a token at a time: bit t % 32 of word t // 32
    clear means token t of a listed row is -inf."""
    out = logits.clone()
    words = bitmask.tolist()
    for r in rows:
        for t in range(logits.shape[1]):
            if not (words[r][t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def bitmask_case(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random logits [6, vocab] and bits, rows 4, 0, 2 masked: row 2 starts with words of all
    ones, row 4 ends with words of none; the last word is part padding unless 32 | vocab."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    bitmask[2, :5] = -1
    bitmask[4, 10:] = 0
    return logits, bitmask, [4, 0, 2]


@pytest.mark.parametrize("vocab", [1000, 1024, 353])
def test_the_bitmask_masks_what_its_bits_say(vocab: int) -> None:
    """-inf exactly where a listed row's bit is clear; other rows and the padding untouched."""
    logits, bitmask, rows = bitmask_case(vocab)
    got = logits.clone()
    cpu_layers.apply_bitmask_cpu(got, bitmask, vocab, rows)
    assert torch.equal(got, masked_by_bits(logits, bitmask, rows))
    wide = torch.randn(6, vocab + 40)  # a row stride past the vocabulary: the rest is kept
    narrow = wide[:, :vocab]
    expected = wide.clone()
    expected[:, :vocab] = masked_by_bits(narrow, bitmask, rows)
    cpu_layers.apply_bitmask_cpu(narrow, bitmask, vocab, rows)
    assert torch.equal(wide, expected)


@pytest.mark.parametrize("march", list(BUILDS))
def test_other_machines_builds_mask_alike(march: str, tmp_path: Path) -> None:
    """The AVX2 and generic builds clear bit by bit; AVX-512 without VBMI as the native."""
    if not _has("avx2", "fma", "f16c", *BUILDS[march]):
        pytest.skip(f"this machine cannot run the {march} build")
    lib = cpu_lib.load(cpu_lib.build(tmp_path, march))
    logits, bitmask, rows = bitmask_case(1000)
    got = logits.clone()
    cpu_layers.apply_bitmask_cpu(got, bitmask, 1000, rows, lib)
    assert torch.equal(got, masked_by_bits(logits, bitmask, rows))
