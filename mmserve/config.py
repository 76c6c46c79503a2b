"""Frozen configuration dataclasses: the one source of truth for settings.

A field made with `setting(...)` is a setting: its default, help text and parser are declared
here, and the `mmserve serve` flag, the MMSERVE_* variable and the LLM(...) keyword are derived
from it (mmserve/settings.py). Fields made otherwise are internal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mmserve.settings import (
    Setting,
    build,
    check_known,
    parse_bytes,
    parse_list,
    setting,
    settings_of,
)

# mmserve.structured_output's backends (its registry is not imported here: it loads torch)
STRUCTURED_BACKENDS = ("xgrammar", "outlines")
# a chat template's render budget (also the offline LLM's: FrontEnd's default), and the worker
# threads of one model's front end (templates, tokenising, images, pooling inputs)
DEFAULT_TEMPLATE_TIMEOUT_MS = 2000
DEFAULT_FRONTEND_THREADS = 4
CPU_GGUF_ACTIVATIONS = ("float32", "int8")  # ModelConfig.cpu_gguf_activations


def _at_least_one(config: object, *names: str) -> None:
    """ValueError naming the setting (flag, variable and keyword alike) that is set below 1."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            setting = next(s for s in settings_of(type(config)) if s.field == name)
            raise ValueError(f"{setting.name} must be >= 1, got {value}")


# prefill_graph_tokens' defaults (ModelConfig.prefill_graph_tokens_for)
PREFILL_GRAPH_TOKENS = 256  # past it a bf16 step's kernels outlast their launches
# FP8 / INT8 w8a8: each projection also quantises its activations, and torch's scaled product
# costs the host about 40 us a call, so an eager 512-token prefill of the 8B shape is bound by
# its launches (11.4 ms of host time for 8.8 of GPU time on an H100). At 8 req/s of 512-token
# prompts graphs up to 1024 took FP8's TTFT p50 from 34.6 to 25.3 ms (bf16's: 32.6 either way).
PREFILL_GRAPH_TOKENS_W8A8 = 1024


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how."""

    model: str  # HF folder, a .gguf file, or a folder holding exactly one .gguf
    dtype: str = setting(
        "auto", "float32, float16 or bfloat16; auto = float32 on CPU, bfloat16 on CUDA"
    )
    device: str = setting("auto", "cpu, cuda or cuda:N; auto = CUDA when present")
    max_model_len: int | None = setting(
        None, "cap on prompt + output tokens", shown="the model's"
    )
    sliding_window_policy: str = setting(
        "honour", "honour = apply the config's sliding window; refuse = error", cli=False
    )
    enforce_eager: bool = setting(False, "run every step eagerly, no CUDA graphs (CUDA only)")
    prefill_graph_tokens: int | None = setting(
        None,
        "the longest step with prompt tokens (a short prompt, a prefix-cache hit, a chunk beside "
        "decodes) replayed from a CUDA graph, padded up to the next captured size; 0 = none "
        "(CUDA only)",
        shown="1024 with FP8 or INT8 weights and activations, else 256",
    )
    warmup: bool | None = setting(
        None,
        "run a few dummy requests at start-up, so that the GPU kernels serving uses are compiled "
        "before the first client waits for them",
        shown="on with CUDA, off on the CPU",
    )
    load_format: str = setting(
        "auto", "auto = the checkpoint's weights; dummy = random (benchmarks)", cli=False
    )
    pooling: str | None = setting(
        None,
        "embeddings' pooling: cls, mean, max or last",
        shown="from the model's sentence-transformers files, else its architecture "
        "(encoders cls, decoders last)",
        cli=False,
    )
    quantization: str | None = setting(
        None,
        "fp8: FP8 weights and activations for Llama-family decoders and the language models "
        "of LLaVA and Qwen2-VL, quantised at load (FP8 tensor cores on CUDA, compute "
        "capability 8.9+; a float32 reference on CPU); int8: INT8 weights and activations "
        "(w8a8) for the same models, quantised at load (Triton INT8 kernels on CUDA, an exact "
        "reference on CPU); other models load unquantised, and ListModels says which are",
    )
    cpu_gguf_activations: str = setting(
        "float32",
        "float32 = a GGUF's products on the CPU in float32, exact; int8 = they meet the "
        "activations quantised to int8 by 32, as llama.cpp computes them (AVX-512 VNNI: 2-5x "
        "faster products; elsewhere float32)",
    )

    def __post_init__(self) -> None:
        _at_least_one(self, "max_model_len")
        if self.cpu_gguf_activations not in CPU_GGUF_ACTIVATIONS:
            raise ValueError(
                f"cpu_gguf_activations must be one of {list(CPU_GGUF_ACTIVATIONS)}, "
                f"got {self.cpu_gguf_activations!r}"
            )
        if self.prefill_graph_tokens is not None and self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")

    def prefill_graph_tokens_for(self, quantization: str) -> int:
        """prefill_graph_tokens, or when unset its default for the model's scheme as run
        (EngineCore.quantization: "fp8", "w8a8-int8", a weight-only scheme, or "")."""
        if self.prefill_graph_tokens is not None:
            return self.prefill_graph_tokens
        w8a8 = quantization in ("fp8", "w8a8-int8")
        return PREFILL_GRAPH_TOKENS_W8A8 if w8a8 else PREFILL_GRAPH_TOKENS


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = setting(16, "tokens per KV cache block")
    num_blocks: int | None = setting(
        None, "KV cache blocks per model", name="num_kv_blocks", shown="from --kv-cache-memory"
    )
    kv_cache_memory_bytes: int = setting(
        512 * 1024 * 1024,
        "KV cache budget per model on CPU when --num-kv-blocks is unset, e.g. 2GiB",
        name="kv_cache_memory",
        parse=parse_bytes,
    )
    gpu_memory_utilization: float = setting(
        0.9, "share of GPU memory the engine may use (weights + KV cache); CUDA only"
    )
    enable_prefix_caching: bool = setting(True, "reuse the KV cache of shared prompt prefixes")
    kv_cache_dtype: str = setting(
        "auto",
        "auto = the model's dtype; fp8 = float8 e4m3 with per-tensor scales of K and V (the "
        "checkpoint's k_scale / v_scale, else 1.0): twice the tokens in the same memory",
    )

    def __post_init__(self) -> None:
        _at_least_one(self, "block_size", "num_blocks", "kv_cache_memory_bytes")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        share = self.gpu_memory_utilization
        if not 0 < share <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {share}")


# The default token budget per step. On the CPU one step's time grows with it (about 1.9 ms per
# token for SmolLM2-135M from its GGUF on 2 cores, BENCHMARKS.md session 19), and every stream of
# the model, and a cancel, waits for the step: 64 tokens keep a step near 0.12 s, and a 2,048-token
# prompt cut into 64-token chunks reaches its first token within 6% of one 2,048-token step. On
# CUDA a step of 2048 tokens takes milliseconds.
CUDA_TOKEN_BUDGET = 2048
CPU_TOKEN_BUDGET = 64


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int | None = setting(
        None,
        "token budget of one engine step (all requests together); it bounds how long one step "
        "(and so every stream's next token, and a cancel) can take",
        shown=f"{CUDA_TOKEN_BUDGET} on CUDA, {CPU_TOKEN_BUDGET} on CPU",
    )
    max_num_seqs: int = setting(64, "requests running at once per model")
    encoder_cache_rows: int = setting(
        16384, "image-encoder output rows kept for reuse (LRU)", cli=False
    )
    max_encoder_rows_per_step: int | None = setting(
        None, "image-encoder rows one step may compute", shown="max_num_batched_tokens", cli=False
    )
    # one step in flight lets the host's work overlap the device's
    async_scheduling: bool = setting(
        True,
        "schedule and launch each step before the previous step's tokens reach the host (one "
        "step in flight), so scheduling, batch building, grammar masks and launches overlap "
        "the GPU",
    )

    def __post_init__(self) -> None:
        _at_least_one(
            self, "max_num_batched_tokens", "max_num_seqs", "encoder_cache_rows",
            "max_encoder_rows_per_step",
        )

    def on_device(self, device_type: str) -> SchedulerConfig:
        """The config with the token budget resolved for a device ("cuda", "cpu")."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = CUDA_TOKEN_BUDGET if device_type == "cuda" else CPU_TOKEN_BUDGET
        return replace(self, max_num_batched_tokens=budget)

    @property
    def budget(self) -> int:
        """max_num_batched_tokens, once on_device() resolved it (the engine core does)."""
        if self.max_num_batched_tokens is None:
            raise ValueError("the token budget is resolved by on_device() first")
        return self.max_num_batched_tokens


# mmserve.speculative's proposers (its registry is not imported here: it loads torch)
SPECULATIVE_METHODS = (
    "ngram", "suffix", "jump", "jump+ngram", "jump+suffix", "draft=PATH", "jump+draft=PATH"
)


def _speculative_method(method: str) -> str:
    """The method with a draft model's path written PATH (to check it against the list)."""
    head, sep, path = method.partition("draft=")
    return f"{head}draft=PATH" if sep and path.strip() else method


MAX_SPECULATIVE_TOKENS = 16  # cap on --num-speculative-tokens


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses the next tokens of a decoding request, and
    one step of the model verifies them (mmserve/speculative/)."""

    method: str | None = setting(
        None,
        "speculative decoding: ngram (prompt lookup), suffix (a suffix trie over the request and "
        "recent outputs of the same tenant), jump (a grammar's forced text, for constrained "
        "requests), draft=PATH (a small model with the same tokenizer, from its folder or GGUF "
        "file), or jump+ngram / jump+suffix / jump+draft=PATH; outputs are the same as without "
        "it (in distribution for sampled requests that a draft model guesses for)",
        name="speculative",
        shown="off",
    )
    num_speculative_tokens: int = setting(
        4, f"most tokens a proposer guesses per request per step (at most {MAX_SPECULATIVE_TOKENS})"
    )
    disable_batch_size: int = setting(
        8,
        "no speculation in a step with more running requests than this (decode is then no "
        "longer bound by reading the weights, and verifying guesses costs more than it saves)",
        name="speculative_disable_batch_size",
    )

    def __post_init__(self) -> None:
        if self.method is not None and _speculative_method(self.method) not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
            )
        _at_least_one(self, "disable_batch_size")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: one process per rank, rank 0's engine core schedules and every
    rank runs each step on its shard (mmserve/engine/tp_workers.py)."""

    tensor_parallel_size: int = setting(
        1,
        "ranks that split each layer of a model (Llama family, LLaVA and Qwen2-VL language "
        "models, BERT/XLM-R), one process each: spawned on this host, or the ranks torchrun "
        "started (RANK, WORLD_SIZE); NCCL on CUDA (one GPU per rank), gloo on CPU",
    )
    distributed_timeout: float = setting(
        60.0,
        "seconds a collective between ranks may wait before the engine is declared dead (its "
        "model turns NOT_SERVING, its calls fail UNAVAILABLE)",
    )

    def __post_init__(self) -> None:
        _at_least_one(self, "tensor_parallel_size")
        if not self.distributed_timeout > 0:
            raise ValueError("distributed_timeout must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = setting(0, "seed of unseeded sampling (the engine-wide generator)")
    # run the engine core in its own process (engine/core_proc.py; grammars are compiled again
    # there). Off here; `mmserve serve` turns it on (ServeOptions.engine_process)
    multiprocess: bool = False

    @classmethod
    def from_settings(cls, model: str, **settings: Any) -> EngineConfig:
        """`model` with the given engine settings (engine_settings(); README's flag table,
        names without dashes, e.g. num_kv_blocks=64); the rest take their defaults. An
        unknown name raises TypeError listing the valid ones."""
        check_known(settings, engine_settings())
        return build(
            cls,
            settings,
            model=build(ModelConfig, settings, model=model),
            cache=build(CacheConfig, settings),
            scheduler=build(SchedulerConfig, settings),
            speculative=build(SpeculativeConfig, settings),
            parallel=build(ParallelConfig, settings),
        )


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens, whom it lets in and how much it takes at once."""

    # loopback by default: exposing the server is a deliberate choice
    host: str = setting("127.0.0.1", "address to listen on (the default: this machine only)")
    port: int = setting(50051, "port; 0 picks a free one (logged)")
    api_key_file: str | None = setting(
        None,
        "API keys, one per line, each optionally followed by a tenant name (# comments); "
        "every call must carry one (see Security)",
    )
    share_prefix_cache_across_keys: bool = setting(
        False,
        "let requests of different API keys (tenants) share prefix-cache blocks and image "
        "uuids; off, each tenant's are its own (no cache-timing side channel between them)",
    )
    tls_cert: str | None = setting(None, "PEM certificate chain: serve TLS (with --tls-key)")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert")
    tls_client_ca: str | None = setting(
        None, "PEM CA bundle: require client certificates it signed (mTLS)"
    )
    max_pending: int = setting(256, "calls in flight per model; more get RESOURCE_EXHAUSTED")
    max_message_bytes: int = setting(
        64 * 1024 * 1024, "largest gRPC message, both directions", parse=parse_bytes
    )
    max_n: int = setting(16, "cap on choices per Generate request")
    max_tokens: int = setting(4096, "cap on max_tokens, and its value when unset")
    max_prompt_tokens: int | None = setting(
        None, "cap on prompt tokens", shown="the model's context"
    )
    shutdown_grace: float = setting(30.0, "seconds running calls get to finish on SIGTERM")
    engine_stall_timeout: float = setting(
        30.0,
        "seconds an engine with work may go without a step before it is declared dead: its "
        "model turns NOT_SERVING and its calls fail UNAVAILABLE (an idle engine never stalls)",
    )
    restart_dead_engines: bool = setting(
        True,
        "start a dead model's engine again (an engine process killed, crashed or stalled; an "
        "in-process one that crashed), at most 3 times in 10 minutes; then it stays down",
    )
    retry_after_s: float = 1.0  # RetryInfo delay suggested with RESOURCE_EXHAUSTED
    metrics_port: int | None = setting(
        None,
        "serve Prometheus metrics over HTTP at /metrics on this port, on --host (0 picks a "
        "free one, logged)",
        shown="off",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        "send one OpenTelemetry span per call to this OTLP/gRPC collector, e.g. "
        "http://127.0.0.1:4317 (needs the otel extra: pip install 'mmserve[otel]')",
        shown="off",
    )
    log_requests: bool = setting(
        False, "put prompts and outputs in the access log (off: only counts and timings)"
    )
    structured_output_backend: str = setting(
        "xgrammar",
        "grammar backend when a request says BACKEND_AUTO: xgrammar or outlines (a grammar, a "
        "structural tag or `disable_any_whitespace`, which outlines cannot compile, goes to "
        "xgrammar)",
    )
    tool_parser: str | None = setting(
        None,
        "force a tool-call format on every model: hermes, llama3_json, mistral or pythonic",
        shown="each model's own",
    )
    reasoning_parser: str | None = setting(
        None,
        "force a reasoning format on every model: deepseek_r1, qwen3, or none (off)",
        shown="each model's own (its chat template tells)",
    )
    media_dir: str | None = setting(
        None,
        "the folder server-side Image.path values must lie in",
        shown="none: Image.path is refused",
    )
    max_image_pixels: int = setting(
        25_000_000, "width x height of one image, checked (from its header) before decoding"
    )
    max_images_per_request: int = setting(
        16, "images in one chat (an Embed batch may hold 16x as many)"
    )
    image_uuid_cache_bytes: int = 512 << 20  # decoded images kept for uuid-only requests
    template_timeout_ms: int = setting(
        DEFAULT_TEMPLATE_TIMEOUT_MS,
        "budget of one chat's template render; a template still running then is stopped and "
        "the call gets INVALID_ARGUMENT",
    )
    frontend_threads: int = setting(
        DEFAULT_FRONTEND_THREADS,
        "worker threads of each model for its chat templates, tokenising, images and pooling "
        "inputs (models never wait on each other's)",
    )

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (mTLS runs over TLS)")
        for name in (
            "max_pending", "max_message_bytes", "max_n", "max_tokens", "max_image_pixels",
            "max_images_per_request", "template_timeout_ms", "frontend_threads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.engine_stall_timeout > 0:
            raise ValueError("engine_stall_timeout must be > 0")
        for name in ("port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {port}")
        if self.structured_output_backend not in STRUCTURED_BACKENDS:
            raise ValueError(
                f"structured_output_backend must be one of {STRUCTURED_BACKENDS}, "
                f"got {self.structured_output_backend!r}"
            )
        if self.media_dir is not None and not Path(self.media_dir).is_dir():
            raise ValueError(f"media_dir {self.media_dir!r} is not a directory")
        if self.tool_parser is not None:
            from mmserve.processors.tool_parsers import get_parser

            get_parser(self.tool_parser)  # an unknown name lists the valid ones
        if self.reasoning_parser not in (None, "none"):
            from mmserve.processors.reasoning_parsers import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # an unknown name lists the valid ones

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


@dataclass(frozen=True)
class ServeOptions:
    """Settings of the `mmserve serve` command itself, beyond one engine's or the server's."""

    model: Sequence[str] = setting(
        (),
        "PATH or NAME=PATH: an HF folder, a .gguf file, or a folder holding one .gguf "
        "(the variable is comma-separated)",
        parse=parse_list,
        shown="the embedded SmolLM2-135M-Instruct and all-MiniLM-L6-v2",
    )
    # on with every device: on the CPU too the front end's Python (tokenising, detokenising,
    # gRPC) otherwise shares the GIL with the engine's steps (BENCHMARKS.md session 19)
    engine_process: bool = setting(
        True,
        "run each engine core in its own process (msgpack over a pipe), so tokenising, "
        "detokenising and gRPC never delay a step",
    )
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: str = setting(
        "text", "text or json: the server log, and its access log of one line per call"
    )

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")


ENGINE_CONFIGS = (
    ModelConfig, CacheConfig, SchedulerConfig, SpeculativeConfig, ParallelConfig, EngineConfig
)


def engine_settings() -> list[Setting]:
    """Every engine setting: the keywords of EngineConfig.from_settings and LLM(...)."""
    return [s for cls in ENGINE_CONFIGS for s in settings_of(cls)]


def serve_settings() -> list[Setting]:
    """The settings of `mmserve serve`, in --help and README order: each a flag and a variable
    (ServeOptions.model is the positional MODEL arguments)."""
    every = [*settings_of(ServeOptions), *settings_of(ServerConfig), *engine_settings()]
    return [s for s in every if s.cli]
