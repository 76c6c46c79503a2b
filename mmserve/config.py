"""Frozen configuration dataclasses: the one source of truth for settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how."""

    model: str  # HF folder, a .gguf file, or a folder holding exactly one .gguf
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on CUDA; else "float32"/"float16"/"bfloat16"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    max_model_len: int | None = None  # cap on prompt + output tokens; None = the model's own limit
    served_name: str | None = None  # name clients use in `model`; None = derived from the path
    sliding_window_policy: str = "honour"  # "honour" = apply the config's window, "refuse" = error
    enforce_eager: bool = False  # True = no CUDA graphs (they apply on CUDA only)
    load_format: str = "auto"  # "auto" = the checkpoint's weights; "dummy" = random (benchmarks)
    pooling: str | None = None  # embeddings' pooling: "cls"/"mean"/"max"/"last"; None = from the
    # model's sentence-transformers files, else its architecture (encoders cls, decoders last)
    quantization: str | None = None  # None = the weights as loaded; "fp8" = w8a8 FP8, quantised
    # when loading (decoder projections: FP8 weights with per-channel scales, activations per token)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # None = sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 512 * 1024 * 1024  # CPU budget when num_blocks is None
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may use
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = 2048  # token budget of one step (all requests together)
    max_num_seqs: int = 64  # cap on running requests
    max_waiting: int = 1024  # admission bound on queued requests (server side)
    encoder_cache_rows: int = 16384  # image-encoder output rows kept for reuse (LRU)
    max_encoder_rows_per_step: int | None = None  # None = max_num_batched_tokens
    # schedule and launch step N+1 before step N's tokens reach the host (one step in flight),
    # so the host's work overlaps the device's; False = one step at a time
    async_scheduling: bool = True


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0  # seed of the engine-wide generator used by unseeded sampling
    # run the engine core in its own process (engine/core_proc.py; grammars are compiled again
    # there). Off here; `mmserve serve` turns it on for CUDA (--[no-]engine-process)
    multiprocess: bool = False
