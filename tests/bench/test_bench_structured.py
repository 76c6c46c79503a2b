"""`mmserve bench structured` end to end on a tiny random model (the compile line covers every
shipped schema; the TPOT lines have sane figures and full-length constrained outputs), and the
shipped schemas on both backends: xgrammar compiles all of them; outlines-core exactly those in
OUTLINES_COMPILES, refusing the others with a pointer at the keyword it would not enforce
(maxLength over 256)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from mmserve.bench.structured import (
    SCHEMAS_DIR,
    load_schemas,
    parse_backends,
    parse_batch_sizes,
    percentile,
    tpot_constraint,
)
from mmserve.structured_output import SchemaError, StructuredOutputParams, create_backend
from tests.bench.conftest import bench_args
from tests.utils.tiny_models import TINY_VOCAB_SIZE, make_tiny_model, make_tiny_tokenizer

OUTLINES_COMPILES = {
    "app_config", "calendar_event", "file_tree", "geo_feature", "github_issue", "invoice",
    "k8s_deployment", "named_entities", "postal_address", "product", "resume", "sentiment",
    "tool_call_choice", "tool_get_weather", "tool_send_email", "tool_web_search",
}  # the others have a maxLength over 256, which outlines' automaton cannot afford
OUTPUT_LEN = 16


def _args(*flags: str) -> argparse.Namespace:
    return bench_args("structured", *flags)


def test_parsing_and_percentiles() -> None:
    assert parse_batch_sizes("1,64") == [1, 64]
    assert parse_backends("xgrammar, outlines") == ["xgrammar", "outlines"]
    for bad in ("", "0", "a,2"):
        with pytest.raises(ValueError, match="--batch-sizes"):
            parse_batch_sizes(bad)
    for bad in ("", "auto", "xgrammar,llguidance"):
        with pytest.raises(ValueError, match="--structured-backend"):
            parse_backends(bad)
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 9.0], 0.99) == 1.0


def test_bench_structured_on_a_tiny_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    model = make_tiny_model(tmp_path, arch="llama", seed=0)
    args = _args(
        "--model", str(model), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-kv-blocks", "64", "--input-len", "12",
        "--output-len", str(OUTPUT_LEN), "--batch-sizes", "1,3",
        "--compile-repeats", "1", "--tpot-repeats", "1",
    )  # fmt: skip
    args.func(args)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (compiled,) = [line for line in lines if line["bench"] == "structured-compile"]
    assert compiled["backend"] == "xgrammar" and compiled["device"] == "cpu"
    assert compiled["num_schemas"] == compiled["compiled"] == len(load_schemas(SCHEMAS_DIR))
    assert compiled["rejected"] == {} and compiled["backend_build_ms"] > 0
    assert 0 < compiled["p50_ms"] <= compiled["p99_ms"] <= compiled["max_ms"]
    tpot = [line for line in lines if line["bench"] == "structured-tpot"]
    assert [line["batch_size"] for line in tpot] == [1, 3]
    for line in tpot:
        assert line["constraint"] == "endless" and math.isfinite(line["tpot_overhead_pct"])
        for side in (line["unconstrained"], line["constrained"]):
            assert 0 < side["tpot_ms_median"] <= side["tpot_ms_p99"]
            assert side["steps_per_s"] > 0
            # the endless schema never lets a constrained request stop early
            assert side["output_tokens_mean"] == OUTPUT_LEN and side["finished_early"] == 0
            # the host's parts of a step (bench/host_times.py): every one ran, and together
            # they take no longer than the same steps did (prefill's among them; the
            # collector's time can fall inside a part, so it is bounded on its own)
            host = side["host_ms_per_step"]
            assert set(host) == {"schedule", "launch", "wait", "sample", "update", "gc"}
            assert all(host[k] > 0 for k in ("schedule", "launch", "wait", "sample", "update"))
            wall = side["host_wall_ms_per_step"]
            assert sum(v for k, v in host.items() if k != "gc") <= wall + 0.01  # rounding
            assert 0 <= host["gc"] <= wall + 0.01
        # a constrained request's text starts the schema's object (whitespace allowed first)
        assert line["constrained"]["sample_output"].lstrip().startswith("{")


def test_shipped_schemas_compile_on_both_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which schemas each backend compiles, not how fast: outlines' build limit (a server's
    guard, 8 s) is lifted, since one of these takes seconds and a loaded machine passed 8."""
    from mmserve.structured_output import outlines_backend

    monkeypatch.setattr(outlines_backend, "BUILD_TIMEOUT_S", 120.0)
    schemas = load_schemas(SCHEMAS_DIR)
    assert len(schemas) >= 20
    tokenizer = make_tiny_tokenizer()
    eos = [tokenizer.eos_token_id]
    compiled: dict[str, set[str]] = {"xgrammar": set(), "outlines": set()}
    for backend_name, names in compiled.items():
        backend = create_backend(backend_name, tokenizer, TINY_VOCAB_SIZE, eos)
        for name, text in schemas.items():
            params = StructuredOutputParams("json_schema", text, backend=backend_name)
            try:
                backend.compile(params)
            except SchemaError as e:
                assert backend_name == "outlines", (name, str(e))
                assert e.pointer.startswith("/"), (name, str(e))
                continue
            names.add(name)
    assert compiled["xgrammar"] == set(schemas)
    assert compiled["outlines"] == OUTLINES_COMPILES
    for backend_name in compiled:  # each backend's default TPOT constraint compiles on it
        backend = create_backend(backend_name, tokenizer, TINY_VOCAB_SIZE, eos)
        name, params = tpot_constraint(backend_name, None)
        backend.compile(params)
        assert name == ("long" if backend_name == "outlines" else "endless")


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ('{"lines": ["a", "b c"], "next": {"lines": [], "next": {"lines": ["x', True),
        ('{ "lines" : [ "q\\"uote", "back\\\\slash", "\\u00e9\\n" ] , "next" :', True),
        ("{" + " " * 32 + '"lines"', True),  # whitespace runs as our JSON schemas bound them
        ("{" + " " * 33, False),
        ('{"lines": ["raw\nnewline', False),  # control characters only escaped, as in JSON
        ('{"lines": ["bad \\x escape', False),
        ('{"lines": ["a" "b"', False),  # a string ends before a comma or the bracket
        ('{"lines": ["a"], "next": ["b"]', False),
    ],
)
def test_endless_grammar_is_json(text: str, accepted: bool) -> None:
    """The TPOT constraint's grammar (written in the form xgrammar fills fast) accepts what
    JSON does and only that: escapes, bounded whitespace, strings that end where JSON's do."""
    xgr = pytest.importorskip("xgrammar")
    from mmserve.bench.structured import ENDLESS_GRAMMAR

    info = xgr.TokenizerInfo(["a", "b"])
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(ENDLESS_GRAMMAR)
    assert xgr.GrammarMatcher(compiled).accept_string(text) is accepted
