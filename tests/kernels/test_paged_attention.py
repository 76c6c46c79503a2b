import pytest
import torch

from mmserve.kernels.paged_attention import (
    choose_num_splits,
    choose_tiling,
    paged_attention,
    paged_attention_ref,
)

# (query_len, seq_len): prefill chunks, decodes, a whole prompt; (5, 200) has a KV tile that
# needs no mask (keys below every query of the chunk) before its diagonal tile.
MIXED = [(9, 30), (1, 17), (12, 12), (1, 1), (5, 200)]


def make_batch(lens, num_kv_heads, group, head_dim, block_size, dtype, device):
    """Random q and cache for requests given as (query_len, seq_len), with shuffled blocks."""
    blocks_per_req = [-(-seq_len // block_size) for _, seq_len in lens]
    num_blocks = sum(blocks_per_req) + 3
    physical = torch.randperm(num_blocks).tolist()
    block_tables = torch.zeros(len(lens), max(blocks_per_req), dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]
    query_lens = torch.tensor([q for q, _ in lens])
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    q = torch.randn(int(query_lens.sum()), num_kv_heads * group, head_dim, dtype=dtype)
    int32 = {"dtype": torch.int32, "device": device}
    return {
        "q": q.to(device),
        "key_cache": cache[0].to(device),
        "value_cache": cache[1].to(device),
        "query_start_loc": torch.cat((torch.zeros(1), query_lens.cumsum(0))).to(**int32),
        "seq_lens": torch.tensor([s for _, s in lens], **int32),
        "block_tables": block_tables.to(device),
        "scale": head_dim**-0.5,
    }


def run(batch, lens, **kwargs):
    """(kernel output, reference output) for a batch from make_batch."""
    causal = kwargs.pop("causal", True)
    window = kwargs.pop("sliding_window", None)
    out = paged_attention(
        **batch,
        max_query_len=max(q for q, _ in lens),
        max_seq_len=max(s for _, s in lens),
        causal=causal,
        sliding_window=window,
        **kwargs,
    )
    return out, paged_attention_ref(**batch, causal=causal, sliding_window=window)


def check(lens, num_kv_heads, group, head_dim, block_size, dtype, device, tol, **kwargs):
    batch = make_batch(lens, num_kv_heads, group, head_dim, block_size, dtype, device)
    out, expected = run(batch, lens, **kwargs)
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("lens", [[(1, 1)], [(1, 37)], [(23, 23)], [(9, 40)]], ids=str)
def test_batch_of_one(lens, dtype, device, tol):
    check(lens, 2, 4, 64, 16, dtype, device, tol)


@pytest.mark.parametrize("block_size", [16, 5])
def test_block_boundary_lengths(block_size, device, tol_f32):
    seq_lens = [k * block_size + d for k in (1, 4) for d in (-1, 0, 1)]
    decodes = [(1, s) for s in seq_lens]
    prefills = [(s, s) for s in seq_lens[:3]]
    check(decodes + prefills, 2, 2, 64, block_size, torch.float32, device, tol_f32)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_ratios_and_head_dims(group, head_dim, dtype, device, tol):
    check([(9, 30), (1, 1), (5, 200)], 2, group, head_dim, 16, dtype, device, tol)


def test_prefill_diagonal_across_kv_tiles(dtype, device, tol):
    # head_dim 128, group 1: 64 query rows against 32-key tiles, so the causal diagonal
    # of one query tile crosses several KV tiles.
    assert choose_tiling(128, 1, 100).block_q > choose_tiling(128, 1, 100).block_n
    check([(100, 130), (70, 70)], 2, 1, 128, 16, dtype, device, tol)


def test_odd_head_dim_and_heads(device, tol_f32):
    # head_dim 80 is padded to 128 inside the kernel; 3 KV heads of 3 query heads each.
    check(MIXED, 3, 3, 80, 7, torch.float32, device, tol_f32)


@pytest.mark.parametrize("window", [1, 17, 150])  # 150: a window with an unmasked tile inside
def test_sliding_window(window, dtype, device, tol):
    check(MIXED + [(1, 300)], 2, 4, 64, 16, dtype, device, tol, sliding_window=window)


def test_non_causal(device, tol_f32):
    check([(7, 7), (13, 13), (1, 1)], 2, 2, 64, 16, torch.float32, device, tol_f32, causal=False)


def split_matches_single_pass(lens, window, dtype, device, tol):
    batch = make_batch(lens, 2, 4, 64, 16, dtype, device)
    single, expected = run(batch, lens, num_splits=1, sliding_window=window)
    torch.testing.assert_close(single, expected, **tol)
    for num_splits in (3, 8):  # 8 splits of 4 KV tiles leaves some splits empty
        split, _ = run(batch, lens, num_splits=num_splits, sliding_window=window)
        torch.testing.assert_close(split, expected, **tol)


@pytest.mark.parametrize("window", [None, 50])
def test_split_kv_decode(window, dtype, device, tol):
    split_matches_single_pass([(1, 200), (1, 129), (1, 7)], window, dtype, device, tol)


@pytest.mark.parametrize("window", [None, 50])
def test_split_kv_mixed_batch(window, device, tol_f32):
    # Splitting is chosen for decode-only batches, but forced on it must hold for any batch.
    lens = [(9, 30), (1, 17), (1, 200)]
    split_matches_single_pass(lens, window, torch.float32, device, tol_f32)


def test_split_kv_short_turn_after_a_long_context(device, tol_f32):
    # a prefix-cache hit: a few dozen query tokens after hundreds of cached ones (split by
    # default on the GPU when the step's programs do not fill it)
    split_matches_single_pass([(40, 700), (3, 300)], None, torch.float32, device, tol_f32)


def test_steps_of_several_tokens_split_only_when_they_leave_the_gpu_idle():
    from mmserve.kernels.paged_attention import auto_num_splits

    # the 8B shape (8 KV heads of 4 query heads, head_dim 128) on 132 SMs
    prefill = choose_tiling(head_dim=128, group=4, max_query_len=64)
    assert (prefill.block_q, prefill.block_n) == (16, 32)
    # a 64-token turn after a 4,096-token cached prompt: 40 programs -> 7 splits (2 per SM)
    assert auto_num_splits(64, 1, 8, 64, 4160, prefill, 132) == 7
    assert auto_num_splits(64, 1, 8, 64, 4160, prefill, 0) == 1  # no GPU
    # a short context: each split at least 4 tiles of 32 keys, so under 256 keys no split
    assert auto_num_splits(64, 1, 8, 64, 200, prefill, 132) == 1
    assert auto_num_splits(64, 1, 8, 64, 300, prefill, 132) == 2
    # a 512-token prompt fills the GPU: (32 + 1) x 8 = 264 programs
    assert auto_num_splits(512, 1, 8, 512, 4160, choose_tiling(128, 4, 512), 132) == 1
    # decode-only batches keep their own rule
    decode = choose_tiling(head_dim=128, group=4, max_query_len=1)
    assert auto_num_splits(1, 1, 8, 1, 4160, decode, 132) == choose_num_splits(8, 4160, decode.block_n, 132)


def test_choose_tiling():
    decode = choose_tiling(head_dim=128, group=8, max_query_len=1)
    assert (decode.block_m, decode.block_q) == (16, 2)  # tl.dot needs 16 rows
    prefill = choose_tiling(head_dim=128, group=8, max_query_len=512)
    assert (prefill.block_m, prefill.block_q) == (64, 8)
    assert choose_tiling(head_dim=80, group=1, max_query_len=3).block_m == 16  # padded to 128
    assert choose_tiling(head_dim=64, group=4, max_query_len=7).block_m == 32  # short prefill
    mqa = choose_tiling(head_dim=64, group=128, max_query_len=4)
    assert (mqa.block_m, mqa.block_q) == (128, 1)
    fp8 = choose_tiling(head_dim=128, group=8, max_query_len=1, fp8_cache=True)
    assert fp8.block_n == 2 * decode.block_n and fp8.block_m == decode.block_m  # same bytes per tile
    assert choose_tiling(128, 8, 512, fp8_cache=True) == prefill


def test_choose_num_splits():
    assert choose_num_splits(8, max_seq_len=32768, block_n=64, num_sms=132) == 32
    assert choose_num_splits(64, max_seq_len=32768, block_n=64, num_sms=132) == 9
    assert choose_num_splits(8, max_seq_len=300, block_n=64, num_sms=132) == 5  # one tile each
    assert choose_num_splits(8, max_seq_len=64, block_n=64, num_sms=132) == 1  # one tile
    assert choose_num_splits(256, max_seq_len=32768, block_n=64, num_sms=132) == 1  # busy
    # fewer programs per SM, longer splits: (the prefill arguments)
    assert choose_num_splits(40, 4160, 32, 132, programs_per_sm=2, min_tiles=4) == 7
    assert choose_num_splits(40, 4160, 32, 132, programs_per_sm=2, min_tiles=64) == 2  # 130 tiles
    assert choose_num_splits(40, 100, 32, 132, programs_per_sm=2, min_tiles=4) == 1
    assert choose_num_splits(8, max_seq_len=32768, block_n=64, num_sms=0) == 1  # no GPU


def test_rejects_bad_inputs(device):
    batch = make_batch([(3, 5)], 2, 2, 64, 16, torch.float32, device)
    lens = {"max_query_len": 3, "max_seq_len": 5}
    bad = {
        "num_heads .* multiple": {"q": batch["q"][:, :3]},
        "must share q.s dtype, or both be float8_e4m3fn": {"key_cache": batch["key_cache"].half()},
        "seq_lens must be torch.int32": {"seq_lens": batch["seq_lens"].long()},
        "block_tables must have shape": {"block_tables": batch["block_tables"][:0]},
        "q must be .*3-D": {"q": batch["q"][0]},
        "head_dim 512": {
            "q": torch.randn(3, 4, 512, device=device),
            "key_cache": torch.randn(1, 16, 2, 512, device=device),
            "value_cache": torch.randn(1, 16, 2, 512, device=device),
        },
    }
    for message, override in bad.items():
        with pytest.raises(ValueError, match=message):
            paged_attention(**{**batch, **override}, **lens)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        paged_attention(**batch, **lens, sliding_window=0)
    with pytest.raises(ValueError, match="scale must be finite"):
        paged_attention(**{**batch, "scale": float("nan")}, **lens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter compiles nothing")
def test_the_number_of_requests_compiles_no_variant(monkeypatch):  # type: ignore[no-untyped-def]
    """num_reqs and the block table's row stride are not specialised: a step of 16 or 32
    requests, or whose block table is 16 or 17 blocks wide (divisible by 16 or not), runs the
    kernel a step of 3 requests and 3 blocks compiled, instead of compiling one of its own while
    serving (the H200 logged one such compile, stride_bt not divisible by 16, session 15)."""
    from triton import knobs

    compiles: list[object] = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda *a, **k: compiles.append(k.get("repr")))
    for i, (n, seq_len) in enumerate(((3, 40), (16, 40), (32, 40), (3, 256), (5, 264))):
        lens = [(3, seq_len)] * n
        out, expected = run(make_batch(lens, 2, 4, 64, 16, torch.bfloat16, "cuda"), lens)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        if i == 0:
            first = len(compiles)
    assert len(compiles) == first
