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

from mmserve.config import EngineConfig
from mmserve.errors import InvalidArgument
from mmserve.server.config import ModelSpec

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
    supports_images: bool = False


@dataclass
class ModelHandle:
    """One hosted model. `engine` is what serves its tasks (an AsyncEngine for generative
    models); a pooling engine will sit here too, under the same interface of tasks."""

    name: str  # what requests put in `model`
    tasks: frozenset[Task]
    engine: Any  # AsyncEngine for GENERATE
    tokenizer: Any  # PreTrainedTokenizerFast
    facts: ModelFacts
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)

    def token_text(self, token_id: int) -> str:
        """A token's text on its own (logprobs); cached, as logprobs repeat tokens a lot."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    @property
    def dead(self) -> BaseException | None:
        """Set when the model's engine loop crashed: the model can serve nothing more."""
        return getattr(self.engine, "dead", None)

    def shutdown(self) -> None:
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
    """The template's settings (device, dtype, cache, scheduler) applied to one model."""
    model = replace(template.model, model=spec.path, served_name=spec.name)
    return replace(template, model=model)


def load_generator(spec: ModelSpec, template: EngineConfig, max_pending: int) -> ModelHandle:
    """Loads a causal LM behind an AsyncEngine (its own stepping thread)."""
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.engine.llm_engine import LLMEngine

    start = time.monotonic()
    engine = LLMEngine.from_config(engine_config_for(spec, template))
    facts = _facts(spec, engine)
    pool = engine.core.kv.pool
    logger.info(
        "model %r ready: %s from %s on %s in %s, context %d tokens, %d KV blocks of %d tokens "
        "(%.1fs)",
        spec.name,
        facts.architecture,
        spec.path,
        facts.device,
        facts.dtype,
        facts.max_context,
        pool.num_blocks,
        template.cache.block_size,
        time.monotonic() - start,
    )
    return ModelHandle(
        spec.name,
        frozenset({Task.GENERATE}),
        AsyncEngine(engine, max_pending=max_pending),
        engine.tokenizer,
        facts,
    )


def _facts(spec: ModelSpec, engine: Any) -> ModelFacts:
    runner = engine.core.runner
    # LLMEngine keeps no HF config; the implementation class is named after the architecture.
    architecture = getattr(engine, "architecture", None) or type(runner.model).__name__
    quant = _GGUF_QUANT.search(Path(spec.path).name)
    return ModelFacts(
        architecture=architecture,
        max_context=engine.max_model_len,
        dtype=str(runner.kv_caches[0].dtype).removeprefix("torch."),
        device=str(runner.device),
        vocab_size=engine.vocab_size,
        quantization=quant.group(1).upper() if quant else "",
    )
