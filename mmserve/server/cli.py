"""`mmserve serve [MODEL ...]` and friends. Every serve flag can also come from the
environment as MMSERVE_<FLAG> (see mmserve/envs.py); the command line wins. Unset flags take
their defaults from the config dataclasses, the one place defaults live."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from mmserve import envs
from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mmserve.server.config import ModelSpec, ServerConfig, embedded_defaults

logger = logging.getLogger("mmserve")

# (flag, type, help); the dest of --max-model-len is max_model_len, as in envs.ServeEnv.
_FLAGS: list[tuple[str, Callable[[str], Any], str]] = [
    ("--host", str, "address to listen on (default 127.0.0.1: this machine only)"),
    ("--port", int, "port to listen on; 0 picks a free one (default 50051)"),
    ("--device", str, "cpu, cuda, cuda:N or auto (default auto)"),
    ("--dtype", str, "auto, float32, float16 or bfloat16 (default auto: float32 on CPU)"),
    ("--max-model-len", int, "cap on prompt + output tokens (default: the model's own)"),
    (
        "--quantization",
        str,
        "fp8: FP8 weights and activations of decoders and VLMs' language models (others as they are)",
    ),
    ("--block-size", int, "tokens per KV cache block (default 16)"),
    ("--max-num-batched-tokens", int, "token budget of one engine step (default 2048)"),
    ("--max-num-seqs", int, "most requests running at once per model (default 64)"),
    ("--num-kv-blocks", int, "KV cache blocks per model (default: from --kv-cache-memory)"),
    ("--kv-cache-memory", envs.parse_bytes, "KV cache budget per model on CPU, e.g. 512MiB"),
    ("--gpu-memory-utilization", float, "share of GPU memory for weights + KV cache (default 0.9)"),
    ("--seed", int, "seed of unseeded sampling (default 0)"),
    ("--api-key-file", str, "file of API keys, one per line (default: no keys)"),
    ("--tls-cert", str, "PEM certificate chain: serve TLS (with --tls-key)"),
    ("--tls-key", str, "PEM private key of --tls-cert"),
    ("--tls-client-ca", str, "PEM CA bundle: require client certificates it signed (mTLS)"),
    ("--max-pending", int, "calls in flight per model before RESOURCE_EXHAUSTED (default 256)"),
    ("--max-message-bytes", envs.parse_bytes, "largest gRPC message either way (default 64MiB)"),
    ("--max-n", int, "cap on choices per Generate request (default 16)"),
    ("--max-tokens", int, "cap on max_tokens, and its value when unset (default 4096)"),
    ("--max-prompt-tokens", int, "cap on prompt tokens (default: the model's context)"),
    ("--shutdown-grace", float, "seconds running calls get to finish on SIGTERM (default 30)"),
    ("--structured-output-backend", str, "xgrammar or outlines (default xgrammar)"),
    ("--tool-parser", str, "hermes, llama3_json, mistral or pythonic (default: from the model)"),
    ("--media-dir", str, "folder that server-side image paths must lie under (default: off)"),
    ("--max-image-pixels", int, "width x height of one image, from its header (default 25000000)"),
    ("--max-images-per-request", int, "images per chat; an Embed call may hold 16x (default 16)"),
    ("--log-level", str, "DEBUG, INFO, WARNING or ERROR (default INFO)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmserve", description="mmserve: LLM inference over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve models over gRPC until SIGTERM / Ctrl-C")
    serve.add_argument(
        "model",
        nargs="*",
        metavar="MODEL",
        help="PATH or NAME=PATH: an HF folder, a .gguf file, or a folder holding one .gguf "
        "[env MMSERVE_MODEL, comma-separated] (default: the embedded SmolLM2-135M-Instruct "
        "and all-MiniLM-L6-v2, served as smollm2-135m-instruct and all-minilm-l6-v2)",
    )
    for flag, kind, text in _FLAGS:
        serve.add_argument(flag, type=kind, help=f"{text} [env {envs.env_name(flag)}]")
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="reuse KV blocks of shared prompt prefixes (default on) "
        "[env MMSERVE_ENABLE_PREFIX_CACHING]",
    )
    serve.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        help="no CUDA graphs: run every step eagerly (default off) [env MMSERVE_ENFORCE_EAGER]",
    )
    serve.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="schedule and launch each step before the previous step's tokens reach the host, "
        "so host work overlaps the device's (default on) [env MMSERVE_ASYNC_SCHEDULING]",
    )
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        help="run each engine core in its own process, so tokenising, detokenising and gRPC "
        "never delay a model step (default: on with CUDA, off on CPU) [env MMSERVE_ENGINE_PROCESS]",
    )
    env = envs.serve_env()
    serve.set_defaults(**{f.name: getattr(env, f.name) for f in fields(env)}, func=_serve)
    # Listed for --help only: main() hands `bench ...` to mmserve.bench.cli untouched.
    sub.add_parser("bench", help="engine benchmarks: mmserve bench KIND --help")
    return parser


def _given(args: argparse.Namespace, *names: str, **renames: str) -> dict[str, Any]:
    """The flags that were set (command line or environment), as dataclass kwargs."""
    pairs = [(n, n) for n in names] + list(renames.items())
    return {key: getattr(args, flag) for key, flag in pairs if getattr(args, flag) is not None}


def engine_template(args: argparse.Namespace) -> EngineConfig:
    """Engine settings shared by every served model (the model path is filled in per model)."""
    share = args.gpu_memory_utilization
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {share}")
    return EngineConfig(
        model=ModelConfig(
            model="",
            **_given(args, "dtype", "device", "max_model_len", "enforce_eager", "quantization"),
        ),
        cache=CacheConfig(
            **_given(
                args,
                "block_size",
                "enable_prefix_caching",
                "gpu_memory_utilization",
                num_blocks="num_kv_blocks",
                kv_cache_memory_bytes="kv_cache_memory",
            )
        ),
        scheduler=SchedulerConfig(
            **_given(args, "max_num_batched_tokens", "max_num_seqs", "async_scheduling")
        ),
        multiprocess=_engine_process(args),
        **_given(args, "seed"),
    )


def _engine_process(args: argparse.Namespace) -> bool:
    """--engine-process as given, else on when the engine will run on CUDA."""
    if args.engine_process is not None:
        return bool(args.engine_process)
    return _cuda_default(args.device or "auto")


def _cuda_default(device: str) -> bool:
    from mmserve.models.loader import resolve_device

    return resolve_device(device).type == "cuda"


def server_config(args: argparse.Namespace) -> ServerConfig:
    names = [f.name for f in fields(ServerConfig) if hasattr(args, f.name)]
    return ServerConfig(**_given(args, *names))


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    return [ModelSpec.parse(m) for m in args.model] if args.model else embedded_defaults()


def _serve(args: argparse.Namespace) -> int:
    from mmserve.server.grpc_server import serve
    from mmserve.server.models import ModelRegistry, load_model

    logging.basicConfig(
        level=(args.log_level or "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config, template, specs = server_config(args), engine_template(args), model_specs(args)
    logger.info(
        "loading %d model(s): %s", len(specs), ", ".join(f"{s.name}={s.path}" for s in specs)
    )
    registry = ModelRegistry([load_model(s, template, config.max_pending) for s in specs])
    asyncio.run(serve(registry, config))
    return 0


def _bench(argv: list[str]) -> int:
    """mmserve.bench.cli, imported only when asked for (it needs torch)."""
    from mmserve.bench import cli as bench_cli

    parser = argparse.ArgumentParser(prog="mmserve")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    bench_cli.run(parser.parse_args(["bench", *argv]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:
            return _bench(argv[1:])
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except (ValueError, OSError) as e:  # bad settings, files or port: say which, no traceback
        print(f"mmserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
