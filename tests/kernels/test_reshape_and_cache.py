import pytest
import torch

from mmserve.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref


def _case(num_tokens, num_kv_heads, head_dim, num_blocks, block_size, dtype, device):
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    cache = torch.randn(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    return k, v, cache, slots


@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size",
    [
        (1, 1, 64, 16),
        (13, 3, 80, 16),
        (29, 2, 128, 5),
    ],
)
def test_matches_reference(num_tokens, num_kv_heads, head_dim, block_size, dtype, device):
    k, v, cache, slots = _case(num_tokens, num_kv_heads, head_dim, 7, block_size, dtype, device)
    expected = cache.clone()
    reshape_and_cache_ref(k, v, expected, slots)
    reshape_and_cache(k, v, cache, slots.to(torch.int32))
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_strided_inputs_and_dtype_cast(device):
    # k, v as column slices of a fused qkv output; the cache is float16.
    qkv = torch.randn(9, 3 * 2 * 64, device=device)
    k = qkv[:, 128:256].view(9, 2, 64)
    v = qkv[:, 256:].view(9, 2, 64)
    cache = torch.randn(2, 4, 8, 2, 64, dtype=torch.float16, device=device)
    slots = torch.tensor([3, -1, 0, 31, 8, 9, 17, -1, 30], device=device)
    expected = cache.clone()
    reshape_and_cache_ref(k, v, expected, slots)
    reshape_and_cache(k, v, cache, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_rejects_bad_shapes(device):
    k, v, cache, slots = _case(4, 2, 64, 3, 16, torch.float32, device)
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        reshape_and_cache(k, v, cache[:, :, :, :1], slots)
    with pytest.raises(ValueError, match="v must have shape"):
        reshape_and_cache(k, v[:3], cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        reshape_and_cache(k, v, cache, slots.float())
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        reshape_and_cache(k, v, cache, slots[:2])


def test_rejects_bad_kv_scales(device):
    k, v, cache, slots = _case(4, 2, 64, 3, 16, torch.float32, device)
    for scales in [(0.0, 1.0), (1.0, float("inf")), (-1.0, 1.0)]:
        with pytest.raises(ValueError, match="kv_scales must be finite and positive"):
            reshape_and_cache(k, v, cache, slots, scales)
