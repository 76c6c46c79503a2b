import pytest
import torch

from mmserve.attention.backend import AttentionMetadata, get_attention_backend

BLOCK_SIZE = 8


def metadata(requests, device, causal=True):
    """requests: (num_computed, num_new, block_ids) each; the new tokens get the next slots."""
    query_lens = [new for _, new, _ in requests]
    seq_lens = [done + new for done, new, _ in requests]
    slots = [
        blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        for done, new, blocks in requests
        for pos in range(done, done + new)
    ]
    width = max(len(blocks) for _, _, blocks in requests)
    tables = [blocks + [0] * (width - len(blocks)) for _, _, blocks in requests]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    int32 = {"dtype": torch.int32, "device": device}
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, **int32),
        seq_lens=torch.tensor(seq_lens, **int32),
        block_tables=torch.tensor(tables, **int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        causal=causal,
    )


def qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device):
    shapes = ((num_heads,), (num_kv_heads,), (num_kv_heads,))
    return [torch.randn(num_tokens, *h, head_dim, dtype=dtype, device=device) for h in shapes]


@pytest.mark.parametrize("window", [None, 11])
def test_matches_torch_backend_over_two_steps(window, dtype, device, tol):
    triton_backend, torch_backend = get_attention_backend("triton"), get_attention_backend("torch")
    cache = torch.randn(2, 12, BLOCK_SIZE, 2, 64, dtype=dtype, device=device)
    expected_cache = cache.clone()
    steps = [  # step 1: a prefill chunk and a whole prompt; step 2: the chunk's rest and a decode
        [(0, 13, [7, 2]), (0, 5, [4])],
        [(13, 9, [7, 2, 10]), (5, 1, [4])],
    ]
    for requests in steps:
        meta = metadata(requests, device)
        q, k, v = qkv(sum(r[1] for r in requests), 8, 2, 64, dtype, device)
        out = triton_backend.forward(q, k, v, cache, meta, 0.125, window)
        expected = torch_backend.forward(q, k, v, expected_cache, meta, 0.125, window)
        torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0)
        torch.testing.assert_close(out, expected, **tol)


def test_encoder_step_without_cache(device, tol_f32):
    meta = metadata([(0, 6, [0]), (0, 11, [1, 2]), (0, 1, [3])], device, causal=False)
    q, k, v = qkv(18, 4, 4, 32, torch.float32, device)
    out = get_attention_backend("triton").forward(q, k, v, None, meta, 0.2)
    expected = get_attention_backend("torch").forward(q, k, v, None, meta, 0.2)
    torch.testing.assert_close(out, expected, **tol_f32)


def test_unsupported_shape_raises(device):
    meta = metadata([(0, 2, [0])], device)
    q, k, v = qkv(2, 4, 4, 512, torch.float32, device)
    cache = torch.randn(2, 1, BLOCK_SIZE, 4, 512, device=device)
    with pytest.raises(ValueError, match="head_dim 512"):
        get_attention_backend("triton").forward(q, k, v, cache, meta, 0.1)
