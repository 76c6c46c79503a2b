"""The models one server hosts: a handle per model (what it can do, its engine, its
tokenizer) and the routing of a request's `model` field to a handle."""

from __future__ import annotations

import enum
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mmserve.config import DEFAULT_FRONTEND_THREADS, DEFAULT_TEMPLATE_TIMEOUT_MS, EngineConfig
from mmserve.engine.messages import EngineInfo
from mmserve.errors import EngineStalled, InvalidArgument
from mmserve.frontend.async_frontend import AsyncFrontEnd
from mmserve.frontend.frontend import FrontEnd
from mmserve.frontend.pooling import MAX_IN_FLIGHT_PER_CALL
from mmserve.models.fp8 import supports_quantization
from mmserve.server.config import ModelSpec, ServerConfig
from mmserve.server.errors import EngineUnavailable

logger = logging.getLogger(__name__)

# Quantisation type as GGUF files spell it in their names (e.g. "...Q4_1.gguf").
_GGUF_QUANT = re.compile(r"[.-](I?Q\d[A-Z0-9_]*|F16|BF16|F32)\.gguf$", re.IGNORECASE)


class Task(enum.Enum):
    """A task a model can serve; each is one RPC."""

    GENERATE = "generate"
    EMBED = "embed"
    RERANK = "rerank"
    CLASSIFY = "classify"
    SCORE = "score"


@dataclass(frozen=True)
class ModelFacts:
    """What ListModels reports about a model besides its name and tasks."""

    architecture: str  # e.g. "LlamaForCausalLM"
    max_context: int  # prompt + output tokens
    dtype: str  # compute dtype, e.g. "float32"
    device: str  # e.g. "cpu", "cuda:0"
    vocab_size: int  # valid token ids are [0, vocab_size)
    quantization: str = ""  # of the source weights, e.g. "Q4_1"; "" when unquantised
    speculative: str = ""  # speculative decoding's method; "" when it does not speculate
    kv_cache_dtype: str = ""  # the KV cache's element type; "" for a model without one
    tensor_parallel_size: int = 1  # ranks the model is split over
    supports_images: bool = False
    score_method: str | None = None  # "cross-encoder" | "cosine" | "yes-token"; None: no Score
    labels: tuple[str, ...] = ()  # a classifier's label names, by label id
    embedding_dimension: int = 0  # full embedding size of a model that embeds; else 0


@dataclass
class ModelHandle:
    """One hosted model: one AsyncFrontEnd serves every task it can do, at the same time."""

    name: str  # what requests put in `model`
    tasks: frozenset[Task]  # the engine's tasks
    engine: AsyncFrontEnd
    tokenizer: Any  # PreTrainedTokenizerFast
    facts: ModelFacts
    config: EngineConfig | None = None  # what its engine was started with; None: no restarts
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)

    def token_text(self, token_id: int) -> str:
        """A token's text on its own (logprobs); cached, as logprobs repeat tokens a lot."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    @property
    def frontend(self) -> FrontEnd:
        return self.engine.frontend

    @property
    def dead(self) -> BaseException | None:
        """Set when the model's engine died (crashed, its process gone) or was declared
        stalled: the model can serve nothing more."""
        return self.engine.dead

    def require_serving(self) -> None:
        """EngineUnavailable (UNAVAILABLE) for a call that reaches a dead engine."""
        if self.engine.dead is not None:
            raise EngineUnavailable(f"model {self.name!r} is not serving: {self.engine.dead}")

    @property
    def restartable(self) -> bool:
        """Whether a new engine can replace the dead one: not while an in-process engine's
        thread may still be inside a stalled step (it holds the model)."""
        if self.config is None or self.engine.dead is None:
            return False
        return self.config.multiprocess or not isinstance(self.engine.dead, EngineStalled)

    def restart(self) -> None:
        """Replaces the dead engine with a new one of the same config (blocking: loads the
        model). Calls keep getting UNAVAILABLE until the new one is in place."""
        if self.config is None:
            raise RuntimeError(f"model {self.name!r} has no engine config to restart with")
        old = self.engine
        old.shutdown()
        frontend = FrontEnd.start(self.config, old.frontend.template_timeout_ms)
        self.engine = AsyncFrontEnd(frontend, max_pending=old.max_pending, threads=old.threads)

    def shutdown(self) -> None:
        """Stops the model's front-end threads, then its engine."""
        self.engine.shutdown()


class ModelRegistry:
    """The hosted models, in load order, and request routing by `model`."""

    def __init__(self, handles: Sequence[ModelHandle]) -> None:
        names = [h.name for h in handles]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {dupes}")
        if not handles:
            raise ValueError("a server needs at least one model")
        self._handles = {h.name: h for h in handles}

    def __iter__(self) -> Iterator[ModelHandle]:
        return iter(self._handles.values())

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def names(self) -> list[str]:
        return list(self._handles)

    def get(self, name: str, task: Task | None = None) -> ModelHandle:
        """The model a request names, checked to do `task` (None: any model, e.g. for
        tokenising). Empty name: the only model that can. Else InvalidArgument on `model`."""
        if name:
            handle = self._handles.get(name)
            if handle is None:
                raise InvalidArgument("model", f"unknown model {name!r}; loaded: {self.names}")
            if task is not None and task not in handle.tasks:
                can = ", ".join(sorted(t.value for t in handle.tasks))
                raise InvalidArgument("model", f"{name!r} cannot {task.value} (it can: {can})")
            return handle
        able = [h for h in self if task is None or task in h.tasks]
        if len(able) == 1:
            return able[0]
        what = "serve this" if task is None else task.value
        if not able:
            raise InvalidArgument("model", f"no loaded model can {what}; loaded: {self.names}")
        names = [h.name for h in able]
        raise InvalidArgument("model", f"required: several models can {what}: {names}")

    def shutdown(self) -> None:
        for handle in self:
            handle.shutdown()


def engine_config_for(spec: ModelSpec, template: EngineConfig) -> EngineConfig:
    """The template's settings (device, dtype, cache, scheduler) applied to one model.
    --quantization applies to the models that can be quantised; the others (encoders,
    CLIP/SigLIP) load as they are, with a warning, and ListModels reports them unquantised."""
    quantization = template.model.quantization
    if quantization and not supports_quantization(spec.path):
        logger.warning(
            "model %r: quantization %s does not apply to it, loaded unquantised",
            spec.name,
            quantization,
        )
        quantization = None
    model = replace(template.model, model=spec.path, quantization=quantization)
    return replace(template, model=model)


def load_models(
    specs: Sequence[ModelSpec], template: EngineConfig, config: ServerConfig
) -> ModelRegistry:
    """The models of specs, each hosted as config says (calls in flight, template budget,
    front-end threads)."""
    return ModelRegistry([
        load_model(
            s, template, config.max_pending, template_timeout_ms=config.template_timeout_ms,
            frontend_threads=config.frontend_threads,
        )
        for s in specs
    ])


def load_model(
    spec: ModelSpec,
    template: EngineConfig,
    max_pending: int,
    *,
    template_timeout_ms: int = DEFAULT_TEMPLATE_TIMEOUT_MS,
    frontend_threads: int = DEFAULT_FRONTEND_THREADS,
) -> ModelHandle:
    """Loads a model behind an AsyncFrontEnd (its own stepping thread and front-end
    workers); its tasks are whatever the engine serves (generation, pooling, or both)."""
    start = time.monotonic()
    config = engine_config_for(spec, template)
    frontend = FrontEnd.start(config, template_timeout_ms)
    handle = replace(handle_for(spec, frontend, max_pending, frontend_threads), config=config)
    facts, num_blocks = handle.facts, frontend.info.num_kv_blocks
    cache = f"{num_blocks} KV blocks of {template.cache.block_size} tokens"
    # (the loader takes the setting only for a GGUF kept in its blocks on the CPU)
    int8 = (
        config.model.cpu_gguf_activations == "int8"
        and facts.device == "cpu"
        and frontend.info.quantization.startswith("gguf:")
    )
    logger.info(
        "model %r ready: %s from %s on %s in %s, tasks %s, context %d tokens, %s (%.1fs)",
        spec.name,
        facts.architecture,
        spec.path,
        facts.device,
        facts.dtype + (" (GGUF products on int8 activations)" if int8 else ""),
        ", ".join(frontend.tasks),
        facts.max_context,
        cache if num_blocks else "no KV cache",
        time.monotonic() - start,
    )
    return handle


def handle_for(
    spec: ModelSpec,
    frontend: FrontEnd,
    max_pending: int,
    frontend_threads: int = DEFAULT_FRONTEND_THREADS,
) -> ModelHandle:
    """A started FrontEnd as a hosted model; starts its AsyncFrontEnd's stepping thread (and
    its frontend_threads workers, as they are needed)."""
    # Admission bounds the calls per model; one pooling call keeps up to
    # MAX_IN_FLIGHT_PER_CALL requests in the engine, so the engine's own bound must allow that.
    bound = max_pending * MAX_IN_FLIGHT_PER_CALL
    return ModelHandle(
        spec.name,
        frozenset(Task(t) for t in frontend.tasks),
        AsyncFrontEnd(frontend, max_pending=bound, threads=frontend_threads),
        frontend.tokenizer,
        _facts(spec, frontend.info),
    )


def _quantization(path: str, loaded: str) -> str:
    """A GGUF's scheme as API.md spells it, "gguf:" and the type its file name says
    ("gguf:Q4_1", "gguf:Q4_K_M"), whether its blocks are kept (EngineInfo says
    "gguf:Q4_1+Q8_0") or dequantised at load (""); "" for a float GGUF (F16, BF16, F32);
    else the engine's ("fp8", "w4a16-g128", ...)."""
    if loaded and not loaded.startswith("gguf:"):
        return loaded
    name = _gguf_file_type(Path(path))
    if name is None:
        quant = _GGUF_QUANT.search(Path(path).name)
        if quant is None:
            return loaded
        name = quant.group(1).upper()
    return "" if name in ("F16", "BF16", "F32") else f"gguf:{name}"


def _gguf_file_type(path: Path) -> str | None:
    """The file's general.file_type (authoritative, whatever the file is called); None for a
    folder, or a file that states none."""
    if not (path.suffix == ".gguf" and path.is_file()):
        return None
    from mmserve.models.gguf import gguf_file_type

    return gguf_file_type(path)


def _facts(spec: ModelSpec, info: EngineInfo) -> ModelFacts:
    return ModelFacts(
        architecture=info.architecture,
        # a pure pooling model's limit is its input limit (sentence-transformers may set one)
        max_context=info.max_model_len if "generate" in info.tasks else info.max_pooling_len,
        dtype=info.dtype,
        device=info.device,
        vocab_size=info.vocab_size,
        quantization=_quantization(spec.path, info.quantization),
        speculative=info.speculative,
        kv_cache_dtype=info.kv_cache_dtype,
        tensor_parallel_size=info.tensor_parallel_size,
        supports_images=info.reads_images or info.embeds_images,
        score_method=info.score_method,
        labels=info.labels,
        embedding_dimension=info.embedding_size or 0,  # set exactly where "embed" is a task
    )
