"""The engine settings of the bench flags every kind shares (cli.py declares them): one
EngineConfig for the offline kinds and for serve.py's server alike."""

from __future__ import annotations

import argparse

from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def engine_config(
    args: argparse.Namespace, model: str, dummy: bool, multiprocess: bool = False
) -> EngineConfig:
    """The engine settings of the shared flags (serve.py's server uses them too, with
    multiprocess; the offline kinds read the in-process core's scheduler and KV cache)."""
    return EngineConfig(
        model=ModelConfig(
            model=model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
            load_format="dummy" if dummy else "auto", enforce_eager=args.enforce_eager,
            quantization=args.quantization,
        ),
        cache=CacheConfig(num_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            async_scheduling=not args.no_async_scheduling,
        ),
        multiprocess=multiprocess,
    )
