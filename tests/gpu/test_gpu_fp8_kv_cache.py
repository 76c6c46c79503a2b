"""The FP8 KV cache on the GPU: the Triton cache writes (plain and fused with rotary) store
what the torch reference stores, paged attention over an FP8 cache matches the reference
read of it, and the engine's greedy tokens (CUDA graphs included) are transformers' with K
and V rounded to e4m3. Skipped without CUDA (the interpreter rounds FP8 wrongly)."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM
from tests.models.test_fp8_kv_cache import GREEDY, PROMPTS, hf_greedy_rounded_kv
from tests.utils.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
FP8 = torch.float8_e4m3fn
SCALES = (0.5, 0.25)


def _cache(num_blocks: int, block: int, heads: int, dim: int) -> torch.Tensor:
    return torch.zeros(2, num_blocks, block, heads, dim, dtype=FP8, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fp8_cache_write_is_the_references(dtype: torch.dtype) -> None:
    from mmserve.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    torch.manual_seed(0)
    k = (torch.randn(37, 3, 80, device="cuda") * 100).to(dtype)  # some past 448 * scale
    v = torch.randn(37, 3, 80, device="cuda").to(dtype)
    slots = torch.randperm(8 * 16, device="cuda")[:37]
    slots[::7] = -1
    got, want = _cache(8, 16, 3, 80), _cache(8, 16, 3, 80)
    reshape_and_cache(k, v, got, slots, SCALES)
    reshape_and_cache_ref(k, v, want, slots, SCALES)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_gpu_fused_rotary_cache_write_rounds_once() -> None:
    """The fused kernel rotates in fp32 and rounds to e4m3 once; the reference rotates, rounds
    to bf16, then to e4m3: they agree to one e4m3 step, almost everywhere exactly."""
    from mmserve.kernels.paged_ref import write_kv_cache
    from mmserve.kernels.rotary import rotary_embedding_and_cache, rotary_embedding_ref

    torch.manual_seed(1)
    t, h, hk, d = 29, 8, 2, 64
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 512, (t,), device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.outer(torch.arange(512, device="cuda").float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(4 * 16, device="cuda")[:t]
    got, want = _cache(4, 16, hk, d), _cache(4, 16, hk, d)
    q_out = rotary_embedding_and_cache(positions, q, k, v, cos, sin, got, slots, SCALES)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cos, sin)
    write_kv_cache(k_ref, v, want, slots, SCALES)
    torch.testing.assert_close(q_out, q_ref, atol=1.6e-2, rtol=1.6e-2)
    a, b = got.float(), want.float()
    assert ((a - b).abs() <= b.abs() / 8 + 1e-3).all()  # within one e4m3 step (3 mantissa bits)
    assert (a != b).float().mean() < 0.02


@pytest.mark.parametrize("queries", [[1, 1, 1], [7, 1, 30]], ids=["decode", "mixed"])
def test_gpu_paged_attention_over_fp8(queries: list[int]) -> None:
    from mmserve.kernels.paged_attention import paged_attention, paged_attention_ref
    from mmserve.kernels.paged_ref import write_kv_cache

    torch.manual_seed(2)
    heads, kv_heads, dim, block = 8, 2, 128, 16
    lens = [300, 45, 90]
    cache = _cache(66, block, kv_heads, dim)
    tables = torch.arange(66, dtype=torch.int32, device="cuda").view(3, 22)[:, :20].contiguous()
    for r, n in enumerate(lens):
        pos = torch.arange(n, device="cuda")
        slots = tables[r].long()[pos // block] * block + pos % block
        write_kv_cache(torch.randn(n, kv_heads, dim, device="cuda"),
                       torch.randn(n, kv_heads, dim, device="cuda"), cache, slots, SCALES)  # fmt: skip
    q = torch.randn(sum(queries), heads, dim, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    args = (q, cache[0], cache[1], starts, seq_lens, tables)
    got = paged_attention(*args, max_query_len=max(queries), max_seq_len=max(lens), scale=dim**-0.5,
                          kv_scales=SCALES)  # fmt: skip
    want = paged_attention_ref(*args, scale=dim**-0.5, kv_scales=SCALES)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_gpu_engine_greedy_is_transformers_with_rounded_kv(
    tmp_path, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    path = str(make_tiny_model(tmp_path, arch="llama"))
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, kv_cache_dtype="fp8")
    assert llm.frontend.info.kv_cache_dtype == "float8_e4m3fn"
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, result in zip(PROMPTS, out, strict=True):
        ids = llm.tokenizer.encode(prompt)
        assert result.outputs[0].token_ids == hf_greedy_rounded_kv(path, ids, 32, monkeypatch), prompt
