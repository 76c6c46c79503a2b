"""The GPU path (Triton attention, CUDA graphs) against the CPU reference path.

Skipped without CUDA; run on the GPU machine with `python -m pytest tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.utils.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [
    "The quick brown fox",
    "Hello world, this is a test of a tiny tokenizer",
    "Paged attention stores keys and values in fixed-size blocks. " * 6,
    "0123",
]


def _outputs(path: str, device: str, dtype: str, **kw: object) -> list[list[int]]:
    llm = LLM(path, device=device, dtype=dtype, num_kv_blocks=128, block_size=16, **kw)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_gpu_greedy_equals_cpu_fp32(tmp_path, arch: str) -> None:  # type: ignore[no-untyped-def]
    extra = {"sliding_window": 24} if arch == "mistral" else {}
    path = str(make_tiny_model(tmp_path, arch=arch, **extra))
    cpu = _outputs(path, "cpu", "float32")
    assert _outputs(path, "cuda", "float32") == cpu
    assert _outputs(path, "cuda", "float32", max_num_batched_tokens=16) == cpu  # chunked


def test_gpu_mixed_graphs_equal_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Steps with prefill tokens replayed from CUDA graphs (prefix hits: a shared prefix, a
    few new tokens; chunks beside decodes) give the CPU path's greedy tokens, in float32."""
    path = str(make_tiny_model(tmp_path, arch="llama"))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [PROMPTS[2][:300] + p[:80] for p in PROMPTS]  # within the tiny model's 256 positions

    def tokens(device: str) -> tuple[list[list[int]], int]:
        llm = LLM(path, device=device, dtype="float32", num_kv_blocks=128, block_size=16, max_num_batched_tokens=64)
        if device == "cuda":
            graphs = llm.frontend.core.runner.mixed_graphs
            assert graphs is not None and graphs._graphs  # captured
        out, cached = [], 0
        for prompt in prompts:  # one by one: each after the first finds the shared prefix
            r = llm.generate([prompt], params, use_tqdm=False)[0]
            out.append(r.outputs[0].token_ids)
            cached += r.num_cached_tokens
        out += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return out, cached

    got, cached = tokens("cuda")
    assert cached > 0
    assert got == tokens("cpu")[0]


def test_gpu_bf16_logits_close(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(make_tiny_model(tmp_path, arch="llama"))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    ref = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64).generate(PROMPTS[:2], params, use_tqdm=False)
    got = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=64).generate(PROMPTS[:2], params, use_tqdm=False)
    for r, g in zip(ref, got):
        first_r, first_g = r.outputs[0].logprobs[0], g.outputs[0].logprobs[0]  # type: ignore[index]
        assert abs(first_r.logprob - first_g.logprob) < 0.1
        assert r.outputs[0].token_ids[0] == g.outputs[0].token_ids[0]


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_gpu_encoder_embeddings_equal_cpu(tmp_path, family: str) -> None:  # type: ignore[no-untyped-def]
    """Encoders on the GPU (Triton attention, fused residual-add + LayerNorm) against the CPU
    path: fp32 within float tolerance, bf16 by cosine."""
    from tests.pooling.tiny_pooling_models import make_tiny_xlm_roberta

    path = str(_tiny_bert(tmp_path) if family == "bert" else make_tiny_xlm_roberta(tmp_path, None))
    texts = [p[:200] for p in PROMPTS]
    ref = torch.tensor(LLM(path, device="cpu", dtype="float32").embed(texts, truncate="right"))
    fp32 = torch.tensor(LLM(path, device="cuda", dtype="float32").embed(texts, truncate="right"))
    torch.testing.assert_close(fp32, ref, atol=1e-4, rtol=1e-4)
    bf16 = torch.tensor(LLM(path, device="cuda", dtype="bfloat16").embed(texts, truncate="right"))
    assert torch.nn.functional.cosine_similarity(bf16, ref).min() > 0.999


def test_gpu_embeddings_match_sentence_transformers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Mean-pooled, normalised embeddings on the GPU against sentence-transformers on the same
    weights, in steps of several inputs of mixed lengths; a Matryoshka cut is normalised after
    the cut. fp32 within float tolerance, bf16 by cosine."""
    from sentence_transformers import SentenceTransformer

    path = str(_tiny_bert(tmp_path))
    texts = [(PROMPTS[i % 4] + " ") * (1 + i % 5) for i in range(37)]
    st = SentenceTransformer(path, device="cuda")
    want = torch.tensor(st.encode(texts, batch_size=8)).cuda()
    llm = LLM(path, device="cuda", dtype="float32", max_num_batched_tokens=512)
    got = torch.tensor(llm.embed(texts, truncate="right")).cuda()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    cut = torch.tensor(llm.embed(texts, dimensions=24, truncate="right")).cuda()
    torch.testing.assert_close(cut, torch.nn.functional.normalize(want[:, :24]), atol=1e-4, rtol=1e-4)
    bf16 = torch.tensor(LLM(path, device="cuda", dtype="bfloat16").embed(texts, truncate="right")).cuda()
    assert torch.nn.functional.cosine_similarity(bf16, want).min() > 0.999


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_gpu_encoder_graphs_equal_eager(tmp_path, family: str) -> None:  # type: ignore[no-untyped-def]
    """Encoder steps replayed from CUDA graphs (padded up to a captured size) equal eager
    steps: cross-encoder scores (BERT's with segment ids) and classifications, for steps of
    1 to 40 inputs of mixed lengths."""
    from tests.pooling.tiny_pooling_models import make_tiny_xlm_roberta

    path = str(_tiny_bert(tmp_path, 1) if family == "bert" else make_tiny_xlm_roberta(tmp_path, 1))
    texts = [(PROMPTS[i % 4] * 3)[: 5 + 11 * i] for i in range(40)]

    def results(eager: bool) -> list[list[float]]:
        llm = LLM(path, device="cuda", dtype="float32", max_num_batched_tokens=1024, enforce_eager=eager)
        assert (llm.frontend.core.runner.encoder_graphs is None) == eager
        out = [llm.score(texts[0], texts[:n], truncate="right") for n in (1, 7, 40)]
        out += [[s.score for c in llm.classify(texts[:n], truncate="right") for s in c.scores] for n in (3, 40)]
        return out

    for got, expected in zip(results(False), results(True), strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=1e-5)


def _tiny_bert(folder, num_labels=None):  # type: ignore[no-untyped-def]
    """A random 2-layer BERT (with mean pooling, or a classifier of num_labels) and the MiniLM
    tokenizer, which the GPU machine has (under MMSERVE_BENCH_DATA) without MiniLM's weights."""
    import json

    from transformers import BertConfig, BertForSequenceClassification

    from mmserve.bench.embed import save_random_bert
    from mmserve.bench.models import make_model_folder

    folder = make_model_folder("bert-base", folder / "bert")
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if num_labels is not None:
        config.update(architectures=["BertForSequenceClassification"], num_labels=num_labels)
    (folder / "config.json").write_text(json.dumps(config))
    if num_labels is None:
        save_random_bert(folder)
    else:
        from tests.pooling.tiny_pooling_models import _randomise  # O(1) weights: scores spread

        model = BertForSequenceClassification(BertConfig.from_pretrained(str(folder)))
        _randomise(model, seed=0).save_pretrained(str(folder))
    return folder


@pytest.fixture(params=["rows-kernel", "one-row-gemv"])
def fp8_rows_path(request, monkeypatch):  # type: ignore[no-untyped-def]
    """FP8's few-row products by the tensor-core rows kernel, or one row by dense_gemv.scaled_gemv."""
    from mmserve.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "ONE_ROW_GEMV", request.param == "one-row-gemv")
    return request.param


@pytest.mark.parametrize("pad_rows", [128, 0])
@pytest.mark.parametrize("rows", [1, 7, 16, 24, 32, 33, 48, 64, 65, 256, 300, 518])  # FEW_ROWS, PAD_ABOVE
def test_gpu_fp8_linear_equals_the_reference(rows: int, pad_rows: int, fp8_rows_path: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The FP8 tensor cores' products (the rows kernel, or one row on scaled_gemv; torch._scaled_mm
    past FEW_ROWS, on rows padded to a multiple of PAD_ROWS past PAD_ABOVE or not; Triton per-token
    quantisation) against the float32 reference of the same FP8 operands."""
    from mmserve.models import fp8 as fp8_module
    from mmserve.models.fp8 import Fp8Linear, fp8_linear_ref

    if fp8_rows_path == "one-row-gemv" and rows > 1:
        pytest.skip("scaled_gemv takes one row")
    monkeypatch.setattr(fp8_module, "PAD_ROWS", pad_rows)
    torch.manual_seed(rows)
    for n, k in [(96, 64), (6144, 4096), (4096, 14336)]:
        linear = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
        fp8 = Fp8Linear.from_linear(linear)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        got = fp8(x)
        expected = fp8_linear_ref(x, fp8.weight, fp8.weight_scale, fp8.bias)
        assert got.dtype == torch.bfloat16
        assert ((got.float() - expected).norm() / expected.norm()).item() < 1e-2
        torch.testing.assert_close(got.float(), expected, atol=0.05 * expected.abs().max().item(), rtol=0.02)


def test_gpu_fp8_engine_equals_cpu(tmp_path, fp8_rows_path: str) -> None:  # type: ignore[no-untyped-def]
    """The FP8 engine on CUDA: float32 (dequantised FP8 products) gives the CPU path's greedy
    tokens; bfloat16 (FP8 tensor cores, CUDA graphs; one row on the rows kernel or on
    scaled_gemv) its first token and logprob."""
    path = str(make_tiny_model(tmp_path, arch="llama"))
    cpu = _outputs(path, "cpu", "float32", quantization="fp8")
    assert _outputs(path, "cuda", "float32", quantization="fp8") == cpu
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    ref = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, quantization="fp8")
    got = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=64, quantization="fp8")
    outputs = [m.generate(PROMPTS[:2], params, use_tqdm=False) for m in (ref, got)]
    for r, g in zip(*outputs, strict=True):
        first_r, first_g = r.outputs[0].logprobs[0], g.outputs[0].logprobs[0]  # type: ignore[index]
        # bf16 rounding before each FP8 quantisation moves a few elements a whole FP8 step:
        # twice the unquantised test's drift allowance (measured 0.102 on the H200)
        assert abs(first_r.logprob - first_g.logprob) < 0.2
        assert r.outputs[0].token_ids[0] == g.outputs[0].token_ids[0]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_gpu_fp8_checkpoint_equals_cpu(tmp_path, static: bool) -> None:  # type: ignore[no-untyped-def]
    """An FP8 checkpoint (compressed-tensors; static input scales or per-token) on CUDA: greedy
    tokens of the CPU path in float32, its first token and logprob in bfloat16."""
    from tests.models.test_fp8 import save_fp8_checkpoint

    src = make_tiny_model(tmp_path, arch="llama", name="model")
    save_fp8_checkpoint(src, tmp_path / "fp8", "tensor" if static else "channel", static)
    path = str(tmp_path / "fp8")
    assert _outputs(path, "cuda", "float32") == _outputs(path, "cpu", "float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    ref = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64)
    got = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=64)
    outputs = [m.generate(PROMPTS[:2], params, use_tqdm=False) for m in (ref, got)]
    for r, g in zip(*outputs, strict=True):
        first_r, first_g = r.outputs[0].logprobs[0], g.outputs[0].logprobs[0]  # type: ignore[index]
        assert abs(first_r.logprob - first_g.logprob) < 0.2  # as test_gpu_fp8_engine_equals_cpu
        assert r.outputs[0].token_ids[0] == g.outputs[0].token_ids[0]
