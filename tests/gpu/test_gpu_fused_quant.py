"""The activation quantisation fused into RMSNorm and SiLU-and-mul on the GPU: real bfloat16
(and float16, float32) inputs and real float8_e4m3fn / int8 outputs, bit for bit those of the
unfused kernel then per_token_quant; and a model with models/quantized_input.py's switch on
gives the logits and greedy tokens (CUDA graphs included) of the switch off, through the fused
kernels. Skipped without CUDA (the interpreter rounds bfloat16 and FP8 wrongly)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.utils.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
PROMPT = "Paged attention stores keys and values in fixed-size blocks."


def _unfused_quant(out: torch.Tensor, out_dtype: torch.dtype, static: Any = None) -> Any:
    from mmserve.kernels.quant import per_token_quant_fp8, per_token_quant_int8

    out = out.reshape(-1, out.shape[-1])
    return per_token_quant_int8(out) if out_dtype == torch.int8 else per_token_quant_fp8(out, out_dtype, static)


def _same(got: Any, want: Any) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.view(torch.uint8) if g.dtype == FP8 else g, w.view(torch.uint8) if w.dtype == FP8 else w)


def _rows(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, width, device="cuda") * torch.logspace(-2, 1, rows, device="cuda")[:, None]
    x[rows // 2] = 0.0  # a zero row
    return x.to(dtype)


@pytest.mark.parametrize(
    "out_dtype,static", [(FP8, False), (FP8, True), (torch.int8, False)], ids=str
)  # static scales: FP8 checkpoints'
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (17, 4097), (300, 1000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_add_rms_norm_quant_is_the_two_kernels(rows: int, hidden: int, dtype: torch.dtype, out_dtype: torch.dtype, static: bool) -> None:  # fmt: skip
    from mmserve.kernels.rmsnorm import add_rms_norm_quant, fused_add_rms_norm, rms_norm

    torch.manual_seed(rows)
    x, residual = _rows(rows, hidden, dtype), _rows(rows, hidden, dtype)
    weight = torch.randn(hidden, device="cuda").to(dtype)
    scale = torch.tensor([0.02], device="cuda") if static else None
    q, s, summed = add_rms_norm_quant(x, residual, weight, 1e-6, out_dtype, scale)
    normed, want_summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    _same((q, s, summed), (*_unfused_quant(normed, out_dtype, scale), want_summed))
    q, s, _ = add_rms_norm_quant(x, None, weight, 1e-6, out_dtype, scale)
    _same((q, s), _unfused_quant(rms_norm(x, weight, 1e-6), out_dtype, scale))


@pytest.mark.parametrize("out_dtype", [FP8, torch.int8], ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 14336), (16, 14336), (300, 1000), (5, 20000)])  # 20000: two passes
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_silu_and_mul_quant_is_the_two_kernels(rows: int, inter: int, dtype: torch.dtype, out_dtype: torch.dtype) -> None:  # fmt: skip
    from mmserve.kernels.activation import silu_and_mul, silu_and_mul_quant

    torch.manual_seed(rows)
    x = _rows(rows, 2 * inter, dtype)
    _same(silu_and_mul_quant(x, out_dtype), _unfused_quant(silu_and_mul(x), out_dtype))
    static = torch.tensor([0.01], device="cuda")
    if out_dtype == FP8:
        _same(silu_and_mul_quant(x, out_dtype, static), _unfused_quant(silu_and_mul(x), out_dtype, static))


def _generate(path: str, quantization: str, fuse: bool, monkeypatch: Any) -> tuple[list[int], list[float]]:
    from mmserve.models import quantized_input

    monkeypatch.setattr(quantized_input, "FUSE_ACTIVATION_QUANT", fuse)
    llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=256, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    logprobs = [lp.logprob for lp in out.prompt_logprobs[1:]]  # type: ignore[index]
    del llm
    torch.cuda.empty_cache()
    return list(out.outputs[0].token_ids), logprobs


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_gpu_the_switch_changes_nothing_and_takes_the_fused_kernels(tmp_path: Any, quantization: str, monkeypatch: Any) -> None:  # fmt: skip
    from mmserve.kernels import activation, rmsnorm

    path = str(make_tiny_model(tmp_path, "llama"))
    want = _generate(path, quantization, False, monkeypatch)
    calls = {"norm": 0, "act": 0}

    def counted(fn: Any, key: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(rmsnorm, "add_rms_norm_quant", counted(rmsnorm.add_rms_norm_quant, "norm"))
    monkeypatch.setattr(activation, "silu_and_mul_quant", counted(activation.silu_and_mul_quant, "act"))
    assert _generate(path, quantization, True, monkeypatch) == want
    assert calls["norm"] > 0 and calls["act"] > 0
