"""Every setting round-trips: flag -> config, MMSERVE_* variable -> config, LLM keyword ->
config; the command line beats the environment; README's flag table is the derived one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mmserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeOptions,
    ServerConfig,
    SpeculativeConfig,
    engine_settings,
    serve_settings,
)
from mmserve.entrypoints import llm as llm_module
from mmserve.server import cli
from mmserve.settings import Setting, parse_bytes

REPO = Path(__file__).resolve().parents[2]
# two valid values of the settings a config checks (the others get generic ones below)
CHOICES = {
    "device": ("cpu", "cuda:1"),
    "dtype": ("float16", "bfloat16"),
    "structured_output_backend": ("outlines", "xgrammar"),
    "tool_parser": ("mistral", "hermes"),
    "reasoning_parser": ("qwen3", "none"),
    "log_level": ("DEBUG", "ERROR"),
    "log_format": ("json", "text"),
    "gpu_memory_utilization": ("0.5", "0.7"),
    "speculative": ("ngram", "jump+suffix"),
    "kv_cache_dtype": ("fp8", "auto"),
    "cpu_gguf_activations": ("int8", "float32"),
}


def _text(s: Setting, which: int, tmp: Path) -> str:
    """A value of the setting as a flag or variable gives it, unlike its default."""
    if s.name in CHOICES:
        return CHOICES[s.name][which]
    if s.name == "media_dir":
        (tmp / str(which)).mkdir(exist_ok=True)
        return str(tmp / str(which))
    if s.is_bool:
        return str(bool(s.default) == bool(which)).lower()  # 0: not the default
    if s.parse is parse_bytes:
        return f"{3 + which}MiB"
    if s.parse in (int, float):
        return str((s.default or 0) + 1 + which)
    return f"value-{which}"


def _flags(settings: list[Setting], which: int, tmp: Path) -> list[str]:
    argv = []
    for s in settings:
        text = _text(s, which, tmp)
        argv += ([s.flag] if text == "true" else [f"--no-{s.flag[2:]}"]) if s.is_bool else [s.flag, text]
    return argv


def _read_back(args: Any, s: Setting) -> Any:
    """The setting's value in the configs `mmserve serve` builds from the parsed args."""
    template = cli.engine_template(args)
    holders = {
        ModelConfig: template.model, CacheConfig: template.cache,
        SchedulerConfig: template.scheduler, EngineConfig: template,
        SpeculativeConfig: template.speculative, ParallelConfig: template.parallel,
        ServerConfig: cli.server_config(args), ServeOptions: cli.serve_options(args),
    }  # fmt: skip
    return getattr(holders[s.owner], s.field)


def _flag_settings() -> list[Setting]:
    return [s for s in serve_settings() if s.name != "model"]  # MODEL is positional


@pytest.mark.parametrize("via", ["flag", "env", "both"])
def test_every_flag_round_trips(via: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _flag_settings()
    if via in ("env", "both"):
        for s in settings:
            monkeypatch.setenv(s.env, _text(s, 1 if via == "both" else 0, tmp_path))
    argv = ["serve", *(_flags(settings, 0, tmp_path) if via in ("flag", "both") else [])]
    args = cli.build_parser().parse_args(argv)
    for s in settings:  # with both, the command line (value 0) wins
        expected = s.parse(_text(s, 0, tmp_path))
        got = _read_back(args, s)
        if s.name == "engine_process":  # it sets EngineConfig.multiprocess
            got = cli.engine_template(args).multiprocess
        assert got == expected != s.default, s.name


def test_unset_settings_take_the_dataclass_defaults() -> None:
    args = cli.build_parser().parse_args(["serve", "--device", "cpu"])
    for s in _flag_settings():
        if s.name not in ("device", "engine_process"):
            assert _read_back(args, s) == s.default, s.name


def test_llm_keywords_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[EngineConfig] = []
    def fake_engine(config: EngineConfig) -> SimpleNamespace:
        built.append(config)
        return SimpleNamespace(tokenizer=None)

    monkeypatch.setattr(llm_module.FrontEnd, "start", fake_engine)
    values = {s.name: s.parse(_text(s, 0, tmp_path)) for s in engine_settings()}
    llm_module.LLM("some/model", **values)
    (config,) = built
    holders = {
        ModelConfig: config.model, CacheConfig: config.cache,
        SchedulerConfig: config.scheduler, EngineConfig: config,
        SpeculativeConfig: config.speculative, ParallelConfig: config.parallel,
    }  # fmt: skip
    assert config.model.model == "some/model"
    for s in engine_settings():
        assert getattr(holders[s.owner], s.field) == values[s.name] != s.default, s.name
    with pytest.raises(TypeError, match="num_kv_blocks"):  # the error lists the valid names
        llm_module.LLM("some/model", num_blocks=4)


def test_llm_keeps_its_keywords() -> None:
    old = {
        "dtype", "device", "max_model_len", "block_size", "num_kv_blocks",
        "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs", "seed", "pooling",
        "enforce_eager", "quantization",
    }  # fmt: skip
    assert old <= {s.name for s in engine_settings()}


def test_readme_table_is_the_derived_one() -> None:
    table = cli.settings_table()
    readme = (REPO / "README.md").read_text()
    assert table in readme, (
        "README.md's `mmserve serve` flag table differs from the settings; regenerate it with\n"
        "  python -c 'from mmserve.server.cli import settings_table; print(settings_table())'\n"
        + table
    )


def test_the_token_budget_default_depends_on_the_device() -> None:
    """Unset, the step budget is CPU_TOKEN_BUDGET on the CPU (a step there takes time in
    proportion: BENCHMARKS.md) and CUDA_TOKEN_BUDGET on CUDA; a given one is kept."""
    from mmserve.config import CPU_TOKEN_BUDGET, CUDA_TOKEN_BUDGET, SchedulerConfig

    unset = SchedulerConfig()
    assert unset.on_device("cpu").budget == CPU_TOKEN_BUDGET < CUDA_TOKEN_BUDGET
    assert unset.on_device("cuda").budget == CUDA_TOKEN_BUDGET
    assert SchedulerConfig(max_num_batched_tokens=77).on_device("cuda").budget == 77
    with pytest.raises(ValueError, match="resolved"):
        _ = unset.budget
