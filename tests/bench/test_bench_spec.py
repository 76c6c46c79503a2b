"""`mmserve bench spec` and `spec-cost` end to end on a tiny model: one line per set, method
and batch size with the fields BENCHMARKS.md reads; the cost run times every k it is given, with guesses checked in every timed step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmserve.bench import cli, speculative
from tests.bench.conftest import bench_args
from tests.utils.tiny_models import make_tiny_model


@pytest.mark.usefixtures("one_thread")
def test_bench_spec_prints_each_set_method_and_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path, max_position_embeddings=2048)  # the sets' prompts are long
    args = bench_args(
        "spec", "--model", str(model), "--device", "cpu", "--spec-sets", "agent,code",
        "--spec-methods", "none,jump+suffix", "--batch-sizes", "1,3", "--output-len", "16",
    )  # fmt: skip
    cli.run(args)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {(r["set"], r["method"], r["batch_size"]) for r in rows} == {
        (s, m, b) for s in ("agent", "code") for m in ("none", "jump+suffix") for b in (1, 3)
    }
    for r in rows:
        assert r["output_tokens"] > 0 and r["tokens_per_step"] > 0
        if r["method"] == "none":
            assert r["draft_tokens"] == 0
    agent = next(r for r in rows if (r["set"], r["method"], r["batch_size"]) == ("agent", "jump+suffix", 1))
    assert agent["accepted_draft_tokens"] > 0  # the tool call's fixed text is guessed


def test_the_sets_are_real_text() -> None:
    for name in ("rewrite", "code", "json", "agent"):
        items = speculative.tasks(name)
        assert len(items) >= 4
        assert all(len(t.messages[-1]["content"]) > 40 for t in items)
    with pytest.raises(ValueError, match="valid: rewrite, code, json, agent"):
        speculative.tasks("poems")


@pytest.mark.usefixtures("one_thread")
def test_bench_spec_cost_times_each_k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_model(tmp_path)
    args = bench_args(
        "spec-cost", "--model", str(model), "--device", "cpu", "--spec-k", "2",
        "--batch-sizes", "1,2", "--input-len", "8",
    )  # fmt: skip
    cli.run(args)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["batch_size"], r["guesses"]) for r in rows] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert all(r["step_ms"] > 0 for r in rows)
    assert [r["ratio_to_one_token"] for r in rows if r["guesses"] == 0] == [1.0, 1.0]


@pytest.mark.usefixtures("one_thread")
def test_bench_spec_cost_times_a_draft_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--spec-draft first:1: the model's first layer drafts (written once under the cache);
    its steps are timed beside the always-wrong guesses of the same k."""
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_model(tmp_path)
    args = bench_args(
        "spec-cost", "--model", str(model), "--device", "cpu", "--spec-k", "2",
        "--batch-sizes", "1", "--input-len", "8", "--spec-draft", "first:1",
    )  # fmt: skip
    cli.run(args)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["guesses"], r["proposer"]) for r in rows] == [
        (0, "always-wrong"), (2, "always-wrong"), (2, "draft")
    ]
    drafts = list((tmp_path / "cache" / "drafts").iterdir())
    assert len(drafts) == 1
    config = json.loads((drafts[0] / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    with pytest.raises(ValueError, match="needs a --model with real weights"):
        speculative.resolve_method("draft=first:1", "shape:llama3-8b")
