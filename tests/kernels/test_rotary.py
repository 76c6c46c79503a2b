import math

import pytest
import torch

from mmserve.kernels.reshape_and_cache import reshape_and_cache_ref
from mmserve.kernels.rotary import (
    rotary_embedding,
    rotary_embedding_and_cache,
    rotary_embedding_ref,
)


def tables(max_pos, head_dim, full, device):
    """cos/sin as HF Llama builds them: [max_pos, D] (halves equal) or just one half."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    if full:
        freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos().to(device), freqs.sin().to(device)


@pytest.mark.parametrize("full", [False, True], ids=["half_table", "full_table"])
@pytest.mark.parametrize(
    "num_tokens,num_heads,num_kv_heads,head_dim",
    [
        (1, 4, 1, 64),
        (13, 6, 2, 128),
        (5, 3, 3, 80),
        (3, 40, 8, 128),  # q spans two head blocks of 32
        (2, 8, 33, 128),  # k spans two head blocks, after q's one
    ],
)
def test_matches_reference(num_tokens, num_heads, num_kv_heads, head_dim, full, dtype, device, tol):
    cos, sin = tables(97, head_dim, full, device)
    positions = torch.randint(0, 97, (num_tokens,), device=device)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    expected_q, expected_k = rotary_embedding_ref(positions, q, k, cos, sin)
    out_q, out_k = rotary_embedding(positions, q, k, cos, sin)
    torch.testing.assert_close(out_q, expected_q, **tol)
    torch.testing.assert_close(out_k, expected_k, **tol)


def test_in_place_on_views_of_fused_qkv(device, tol_f32):
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    qkv = torch.randn(9, (num_heads + 2 * num_kv_heads) * head_dim, device=device)
    q = qkv[:, : num_heads * head_dim].view(9, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        9, num_kv_heads, head_dim
    )
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    cos, sin = tables(64, head_dim, True, device)
    positions = torch.arange(20, 29, dtype=torch.int32, device=device)
    expected_q, expected_k = rotary_embedding_ref(positions, q, k, cos, sin)
    out_q, out_k = rotary_embedding(positions, q, k, cos, sin, inplace=True)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, expected_q, **tol_f32)
    torch.testing.assert_close(k, expected_k, **tol_f32)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


def test_neox_pairs_dimension_i_with_i_plus_half(device):
    angle = 0.3
    cos = torch.tensor([[1.0, 1.0], [math.cos(angle), 1.0]], device=device)
    sin = torch.tensor([[0.0, 0.0], [math.sin(angle), 0.0]], device=device)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], device=device)
    out, _ = rotary_embedding(torch.tensor([1], device=device), x, x.clone(), cos, sin)
    c, s = math.cos(angle), math.sin(angle)
    expected = torch.tensor([1 * c - 3 * s, 2.0, 3 * c + 1 * s, 4.0])
    torch.testing.assert_close(out[0, 0].cpu(), expected)


def test_rejects_bad_inputs(device):
    q, k = torch.randn(3, 2, 64, device=device), torch.randn(3, 1, 64, device=device)
    cos, sin = tables(8, 64, False, device)
    positions = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="cos must be"):
        rotary_embedding(positions, q, k, cos[:, :31], sin[:, :31])
    with pytest.raises(ValueError, match="sin must have shape"):
        rotary_embedding(positions, q, k, cos, sin[:4])
    with pytest.raises(ValueError, match="positions must be"):
        rotary_embedding(positions.float(), q, k, cos, sin)
    with pytest.raises(ValueError, match="k must have shape"):
        rotary_embedding(positions, q, k[:, :, :32], cos, sin)


@pytest.mark.parametrize(
    "num_tokens,num_heads,num_kv_heads,head_dim,block_size",
    [
        (1, 4, 1, 64, 16),  # a decode token
        (13, 6, 2, 128, 16),
        (7, 40, 8, 128, 5),  # q spans two head blocks; odd block size
        (5, 3, 3, 80, 16),  # head_dim not a power of two
    ],
)
def test_rotary_and_cache_equals_rotary_then_cache(
    num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, tol
):
    """One launch: q rotated out, k rotated and v written to their slots (-1 skipped)."""
    cos, sin = tables(97, head_dim, False, device)
    positions = torch.randint(0, 97, (num_tokens,), device=device)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    cache = torch.randn(2, 6, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    slots = torch.randperm(6 * block_size, device=device)[:num_tokens]
    slots[1::3] = -1  # padding tokens: nothing written
    expected_q, expected_k = rotary_embedding_ref(positions, q, k, cos, sin)
    expected = cache.clone()
    reshape_and_cache_ref(expected_k, v, expected, slots)
    out_q = rotary_embedding_and_cache(positions, q, k, v, cos, sin, cache, slots)
    torch.testing.assert_close(out_q, expected_q, **tol)
    torch.testing.assert_close(cache, expected, **tol)
