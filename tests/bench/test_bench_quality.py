"""`mmserve bench quality` on a tiny random Llama and a short text: float32 against itself is
exact, every quantised scheme moves the distribution by a finite amount and is served as the
scheme it names, the recorded rows are the model's logits at each position, and the metrics
match a hand computation (the re-quantised checkpoint's weights: test_requantize.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mmserve.bench import cli, quality
from tests.bench.conftest import bench_args
from tests.utils.tiny_models import make_tiny_hf_model, make_tiny_model

pytest.importorskip("compressed_tensors")
TEXT = (
    "Paged attention stores keys and values in fixed-size blocks. The quick brown fox jumps "
    "over the lazy dog. What is the capital of France? The capital of France is Paris. "
) * 3
FIELDS = {"scheme", "kl_mean", "kl_median", "kl_p99", "top1_agreement", "tokens", "windows",
          "perplexity", "reference_perplexity", "served_quantization", "kv_cache_dtype"}  # fmt: skip


def test_the_metrics_are_a_hand_computation() -> None:
    """P against Q per row: (1/2, 1/4, 1/4) || (4/5, 1/10, 1/10): KL = ln(5/4) (the other way
    round it would be 0.19), same argmax; (1/4, 1/4, 1/2) || (1/2, 1/4, 1/4): KL = ln(2) / 4,
    other argmaxes; a distribution against its logits shifted by a constant: 0, same argmax."""
    p = [[0.5, 0.25, 0.25], [0.25, 0.25, 0.5], [0.2, 0.3, 0.5]]
    q = [[0.8, 0.1, 0.1], [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]
    ref = torch.tensor(p, dtype=torch.float64).log()
    other = torch.tensor(q, dtype=torch.float64).log()
    other[2] += 3.0
    d = quality.divergence(ref, other)
    low, high = math.log(2) / 4, math.log(5 / 4)
    assert d.kl.tolist() == pytest.approx([high, low, 0.0], abs=1e-12)
    assert d.same_top1.tolist() == [True, False, True]
    s = d.summary()
    assert s["kl_mean"] == pytest.approx((high + low) / 3)
    assert s["kl_median"] == pytest.approx(low)
    assert s["kl_p99"] == pytest.approx(low + 0.98 * (high - low))  # (interpolated: rank 1.98 of 0-2)
    assert (s["top1_agreement"], s["tokens"]) == (pytest.approx(2 / 3), 3)


@pytest.mark.usefixtures("one_thread")
def test_bench_quality_prints_each_scheme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_model(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = bench_args(
        "quality", "--model", str(model), "--device", "cpu", "--text", str(text), "--window", "48",
        "--schemes", "float32,w4a16-g32,int8,fp8,fp8-kv,float32+q8",
    )  # fmt: skip
    cli.run(args)
    rows = {r["scheme"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(rows) == ["float32", "w4a16-g32", "int8", "fp8", "fp8-kv", "float32+q8"]
    assert all(FIELDS <= r.keys() for r in rows.values())
    tokens = {r["tokens"] for r in rows.values()}
    assert len(tokens) == 1 and tokens.pop() > 2 * 48  # the whole text, in several windows
    exact = rows.pop("float32")
    assert (exact["kl_mean"], exact["kl_p99"], exact["top1_agreement"]) == (0.0, 0.0, 1.0)
    assert exact["perplexity"] == exact["reference_perplexity"]
    for name, r in rows.items():
        assert 0.0 < r["kl_median"] <= r["kl_p99"] < math.inf, name
        assert 0.0 < r["kl_mean"] < math.inf and r["top1_agreement"] < 1.0, name
    served = {name: (r["served_quantization"], r["kv_cache_dtype"]) for name, r in rows.items()}
    assert served == {"w4a16-g32": ("w4a16-g32", "float32"), "int8": ("w8a8-int8", "float32"),
                      "fp8": ("fp8", "float32"), "fp8-kv": ("", "float8_e4m3fn"),
                      "float32+q8": ("", "float32")}  # fmt: skip


@pytest.mark.usefixtures("one_thread")
def test_the_recorded_rows_are_the_logits_at_each_position(tmp_path: Path) -> None:
    """Against transformers on the same weights, window by window (each from scratch)."""
    from mmserve.config import EngineConfig
    from mmserve.frontend.frontend import FrontEnd

    model = make_tiny_model(tmp_path, seed=3)
    hf = make_tiny_hf_model(seed=3)
    engine = FrontEnd.start(EngineConfig.from_settings(str(model), device="cpu", dtype="float32"))
    try:
        ids = list(engine.tokenizer.encode(TEXT))
        windows = quality.text_windows(ids, 40, 70)
        run = quality.serve_windows(engine, windows)
    finally:
        engine.shutdown()
    assert [len(w) for w in windows] == [40, 30]
    for window, logits in zip(windows, run.logits, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([window])).logits[0]
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    assert run.nll.shape == (39 + 29,)


def test_rows_that_do_not_match_the_served_logprobs_are_refused() -> None:
    from mmserve.outputs import TokenLogprob

    rows = torch.randn(3, 5)
    served = [None] + [
        TokenLogprob(t, float(torch.log_softmax(rows[i], -1)[t]), 1) for i, t in enumerate([2, 4])
    ]
    assert quality._check_rows(rows, [0, 2, 4], served).shape == (2,)
    with pytest.raises(RuntimeError, match="are not those"):
        quality._check_rows(rows.flip(0), [0, 2, 4], served)
    with pytest.raises(RuntimeError, match="recorded 2 logit rows"):
        quality._check_rows(rows[:2], [0, 2, 4], served)


@pytest.mark.usefixtures("one_thread")
def test_q8_rounds_every_decoder_projections_input(tmp_path: Path) -> None:
    """+q8's hooks: each layer's four projections (not the LM head) see their input as
    q8_round_trip leaves it."""
    from mmserve.config import EngineConfig
    from mmserve.frontend.frontend import FrontEnd
    from mmserve.kernels._common import q8_round_trip

    engine = FrontEnd.start(EngineConfig.from_settings(str(make_tiny_model(tmp_path)), device="cpu", dtype="float32"))
    try:
        model = engine.core.runner.model
        qkv = model.model.layers[1].self_attn.qkv_proj
        x = torch.randn(3, 64)
        with torch.no_grad():
            want, plain = qkv(q8_round_trip(x)), qkv(x)
            assert quality.round_projection_inputs(model) == 4 * 2
            got = qkv(x)
            head = model.lm_head(x)
        assert torch.equal(got, want) and not torch.equal(got, plain)
        torch.testing.assert_close(head, torch.nn.functional.linear(x, model.lm_head.weight))
    finally:
        engine.shutdown()


def test_schemes_and_windows() -> None:
    assert quality.parse_scheme("w8a16") == quality.Scheme("w8a16", weight_bits=8)
    assert quality.parse_scheme("w4a16-g64").group_size == 64
    assert quality.parse_scheme("w4a16-g64+q8") == quality.Scheme("w4a16-g64+q8", weight_bits=4, group_size=64,
                                                                  q8_activations=True)  # fmt: skip
    with pytest.raises(ValueError, match="only float32 and wNa16 schemes take"):
        quality.parse_scheme("int8+q8")
    with pytest.raises(ValueError, match="only float32 and wNa16 schemes take"):
        quality.parse_scheme("gguf-a8+q8")
    assert quality.parse_scheme("gguf-a8").cpu_gguf_activations == "int8"
    with pytest.raises(ValueError, match="valid: float32, int8, fp8, fp8-kv, gguf-a8, w4a16-gG"):
        quality.parse_scheme("w3a16")
    assert quality.text_windows(list(range(9)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert quality.text_windows(list(range(9)), 4, 6) == [[0, 1, 2, 3], [4, 5]]
