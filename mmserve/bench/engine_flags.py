"""The engine flags every bench kind shares, derived from the engine settings as `mmserve
serve`'s are (mmserve/settings.py): the same names, help and parsing; defaults are the
settings', except where a benchmark wants a bigger engine (BENCH_DEFAULTS). One EngineConfig
for the offline kinds and for serve.py's server alike."""

from __future__ import annotations

import argparse
from dataclasses import replace

from mmserve.config import EngineConfig, engine_settings
from mmserve.settings import Setting, add_flag

# A benchmark's engine is sized for throughput runs, not a small server's defaults.
BENCH_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 4096}
# --seed is serve's, of its prompts and arrival times; the engine's sampling seed stays 0
NOT_FLAGS = frozenset({"seed"})


def _flagged() -> list[Setting]:
    return [s for s in engine_settings() if s.cli and s.name not in NOT_FLAGS]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per engine setting of `mmserve serve`, with its default set (bench kinds read
    args.device, args.dtype, ... directly)."""
    for s in _flagged():  # no MMSERVE_* variables here: a benchmark's command line says all
        default = BENCH_DEFAULTS.get(s.name, s.default)
        shown = default if s.name in BENCH_DEFAULTS else s.shown
        add_flag(parser, s, default, help=f"{s.help} (default {shown})")


def engine_config(
    args: argparse.Namespace, model: str, dummy: bool, multiprocess: bool = False
) -> EngineConfig:
    """The engine settings of the shared flags (serve.py's server uses them too, with
    multiprocess; the offline kinds read the in-process core's scheduler and KV cache)."""
    given = {s.name: getattr(args, s.name) for s in _flagged()}
    config = EngineConfig.from_settings(model, **given)
    load_format = "dummy" if dummy else "auto"
    return replace(config, model=replace(config.model, load_format=load_format), multiprocess=multiprocess)
