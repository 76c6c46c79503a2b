"""The FP8 KV cache (`--kv-cache-dtype fp8`) on the CPU path: values are stored as
e4m3(clamp(x / scale, +-448)) and read back times the scale; attention over such a cache is
attention over those rounded values (against torch's own SDPA on them); the engine's greedy
tokens are those of transformers with its K and V rounded the same way; a checkpoint's
k_scale / v_scale are used; the same memory holds more blocks; ListModels says the dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mmserve import LLM, SamplingParams
from mmserve.attention import AttentionMetadata, get_attention_backend
from mmserve.kernels.paged_ref import FP8, gather_context, to_fp8, write_kv_cache
from tests.entrypoints.test_llm_offline import hf_model
from tests.utils.tiny_models import make_tiny_model

PROMPTS = [
    "Paged attention stores keys and values in fixed-size blocks. " * 3,
    "a b c a b c a b c a b",
    "def f(x):\n    return x + 1\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def rounded(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x after a trip through the FP8 cache: written from torch's own e4m3 cast, read back."""
    return (x.double() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale


def test_the_cache_holds_each_value_rounded_to_e4m3() -> None:
    torch.manual_seed(0)
    k = torch.randn(9, 2, 16) * 40  # some beyond 448 / scale: saturated
    v = torch.randn(9, 2, 16)
    cache = torch.zeros(2, 4, 4, 2, 16, dtype=FP8)
    slots = torch.tensor([0, 5, -1, 7, 8, 2, 15, 11, 3])
    write_kv_cache(k, v, cache, slots, scales=(0.25, 0.5))
    table = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    got_k, got_v = gather_context(cache, table, 16, scales=(0.25, 0.5))
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(got_k[slot].double(), rounded(k[i], 0.25), atol=0, rtol=0)
            torch.testing.assert_close(got_v[slot].double(), rounded(v[i], 0.5), atol=0, rtol=0)
    assert got_k.abs().max() <= 448 * 0.25
    assert to_fp8(torch.tensor([1e6, -1e6]), 1.0).float().tolist() == [448.0, -448.0]


def test_attention_over_an_fp8_cache_is_sdpa_on_the_rounded_values() -> None:
    """Two requests (a prefill chunk after cached context, and a decode) through the CPU
    backend with an FP8 cache, against scaled_dot_product_attention in float64 on K/V
    rounded through e4m3 with the same scales."""
    torch.manual_seed(1)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    lens, queries = [11, 6], [3, 1]
    scales = (0.5, 2.0)
    cache = torch.zeros(2, 8, block, kv_heads, dim, dtype=FP8)
    tables = torch.tensor([[0, 1, 2], [5, 6, 0]], dtype=torch.int32)
    backend = get_attention_backend("torch")
    ks = [torch.randn(n, kv_heads, dim) * 3 for n in lens]
    vs = [torch.randn(n, kv_heads, dim) * 3 for n in lens]
    slot = [[int(tables[r, p // block]) * block + p % block for p in range(n)] for r, n in enumerate(lens)]
    # the context before this step, written as earlier steps would have
    for r, n in enumerate(lens):
        old = n - queries[r]
        write_kv_cache(ks[r][:old], vs[r][:old], cache, torch.tensor(slot[r][:old]), scales)
    q = torch.randn(sum(queries), heads, dim)
    new_k = torch.cat([ks[r][lens[r] - queries[r] :] for r in range(2)])
    new_v = torch.cat([vs[r][lens[r] - queries[r] :] for r in range(2)])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slot[0][-3:] + slot[1][-1:]),
        max_query_len=3, max_seq_len=11, query_lens_cpu=queries, seq_lens_cpu=lens,
    )  # fmt: skip
    out = backend.forward(q, new_k, new_v, cache, meta, 0.25, kv_scales=scales)
    row = 0
    for r, n in enumerate(lens):
        k = rounded(ks[r], scales[0]).repeat_interleave(2, dim=1).transpose(0, 1)  # [H, S, D]
        v = rounded(vs[r], scales[1]).repeat_interleave(2, dim=1).transpose(0, 1)
        qr = q[row : row + queries[r]].double().transpose(0, 1)  # [H, Q, D]
        allowed = torch.arange(n)[None, :] <= torch.arange(n - queries[r], n)[:, None]
        want = F.scaled_dot_product_attention(qr, k, v, attn_mask=allowed, scale=0.25)
        got = out[row : row + queries[r]].double().transpose(0, 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        row += queries[r]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("fp8kv"), "llama"))


@torch.no_grad()
def hf_greedy_rounded_kv(
    path: str, prompt_ids: list[int], n: int, monkeypatch: pytest.MonkeyPatch,
    scales: tuple[float, float] = (1.0, 1.0),
) -> list[int]:  # fmt: skip
    """transformers' greedy tokens with every K (after rotary) and V rounded through e4m3 at
    the given scales, as an FP8 cache holds them."""
    from transformers.models.llama import modeling_llama

    rotary = modeling_llama.apply_rotary_pos_emb

    def rotary_then_round(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = rotary(*args, **kwargs)
        return q, rounded(k, scales[0]).to(k.dtype)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotary_then_round)
    model = hf_model(path)
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(
            lambda _m, _i, out: rounded(out, scales[1]).to(out.dtype)
        )
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_is_transformers_with_rounded_kv(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(tiny, kv_cache_dtype="fp8", kv_cache_memory=8 << 20)
    assert llm.frontend.info.kv_cache_dtype == "float8_e4m3fn"
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    plain = LLM(tiny, kv_cache_memory=8 << 20).generate(PROMPTS, GREEDY, use_tqdm=False)
    differs = 0
    for prompt, result, base in zip(PROMPTS, out, plain, strict=True):
        ids = llm.tokenizer.encode(prompt)
        want = hf_greedy_rounded_kv(tiny, ids, 32, monkeypatch)
        assert result.outputs[0].token_ids == want, prompt
        differs += result.outputs[0].token_ids != base.outputs[0].token_ids
    assert differs  # the rounding shows: the reference is not just the unrounded model


def test_a_checkpoints_kv_scales_are_used(
    tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """k_scale / v_scale tensors in the checkpoint (as llm-compressor writes them) set each
    layer's scales; the greedy tokens follow transformers rounded at those scales."""
    folder = tmp_path / "scaled"
    folder.mkdir()
    for f in Path(tiny).iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(Path(tiny) / "model.safetensors"))
    layers = json.loads((Path(tiny) / "config.json").read_text())["num_hidden_layers"]
    scales = (0.0625, 0.03125)  # coarse enough that the rounding differs from scale 1
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(scales[0])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(scales[1])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(folder), kv_cache_dtype="fp8", kv_cache_memory=8 << 20)
    model = llm.frontend.core.runner.model
    assert {m.kv_scales for m in model.modules() if hasattr(m, "kv_scales")} == {scales}
    prompt = PROMPTS[0]
    got = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    ids = llm.tokenizer.encode(prompt)
    assert got == hf_greedy_rounded_kv(str(folder), ids, 32, monkeypatch, scales)
    # unscaled the same checkpoint loads too (the scales are not weights of the model)
    assert LLM(str(folder), kv_cache_memory=8 << 20).generate([prompt], GREEDY, use_tqdm=False)


def test_the_same_memory_holds_more_blocks_and_bad_values_are_refused(tiny: str) -> None:
    plain = LLM(tiny, kv_cache_memory=8 << 20)
    fp8 = LLM(tiny, kv_cache_memory=8 << 20, kv_cache_dtype="fp8")
    assert fp8.frontend.core.num_kv_blocks == 4 * plain.frontend.core.num_kv_blocks  # float32 -> 1 byte
    assert plain.frontend.info.kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or fp8"):
        LLM(tiny, kv_cache_dtype="int4")
