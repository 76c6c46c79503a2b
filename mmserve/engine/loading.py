"""Builds an engine core from an EngineConfig (weights, tokenizer facts, KV cache) and the
EngineInfo it answers to the layers above."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from mmserve.attention import get_attention_backend
from mmserve.config import EngineConfig, ModelConfig
from mmserve.engine.engine_core import EngineCore
from mmserve.engine.messages import EngineInfo
from mmserve.engine.pooling_setup import PoolingSetup, pooling_setup
from mmserve.engine.tp_workers import Ranks, start_ranks
from mmserve.heap import freeze_heap
from mmserve.models.base import CausalLM
from mmserve.models.gguf_cache import materialize
from mmserve.models.loader import (
    ModelSource,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_model_source,
    tp_model_path,
)
from mmserve.models.registry import architecture_of
from mmserve.processors.tokenizer import eos_token_ids, load_tokenizer, vocab_size
from mmserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 4096  # when the config states no limit


@dataclass
class LoadedEngine:
    """An engine core with what its front end needs to start."""

    core: EngineCore
    info: EngineInfo
    tokenizer: Any  # the model's transformers tokenizer, loaded once here


def load_engine(config: EngineConfig) -> LoadedEngine:
    start = time.monotonic()
    tp = config.parallel.tensor_parallel_size > 1
    # the config and tokenizer of a GGUF's converted folder; load_model reads the GGUF
    # (dequantised from that folder, or its blocks from the file itself), and so does each
    # rank, unless its blocks are not kept: then the ranks read their slices of the folder's
    # weights, converted once here (tp_model_path)
    source = materialize(resolve_model_source(config.model.model), weights=False)
    model_config = replace(config.model, model=tp_model_path(config.model)) if tp else config.model
    ranks = None
    if config.parallel.tensor_parallel_size > 1:  # the other ranks load their shards meanwhile
        ranks = start_ranks(replace(config, model=model_config))
    try:
        loaded = _load(config, model_config, source, ranks, start)
    except BaseException:
        if ranks is not None:
            ranks.shutdown()
        raise
    freeze_heap()  # start-up's objects out of the collector's full passes (mmserve.heap)
    return loaded


def _load(
    config: EngineConfig,
    model_config: ModelConfig,
    source: ModelSource,
    ranks: Ranks | None,
    start: float,
) -> LoadedEngine:
    device = resolve_device(config.model.device if ranks is None else ranks.parallel.device)
    dtype = resolve_dtype(config.model.dtype, device)
    backend = get_attention_backend("triton" if device.type == "cuda" else "torch")
    parallel = None if ranks is None else ranks.parallel
    model, hf_config, gen_config = load_model(model_config, device, dtype, backend, parallel)
    tokenizer = load_tokenizer(source.folder, source.gguf_file)
    # a model may know better than its config (XLM-R spends two positions on padding)
    model_max_len = (
        model.max_model_len
        or getattr(hf_config, "max_position_embeddings", None)
        or DEFAULT_MAX_MODEL_LEN
    )
    setup = pooling_setup(model, hf_config, source.folder, tokenizer, config.model.pooling)
    eos = frozenset(eos_token_ids(tokenizer, getattr(gen_config, "eos_token_id", None)))
    structured = None
    if "generate" in setup.tasks:
        structured = StructuredOutputManager(tokenizer, model.vocab_size, sorted(eos))
    core = EngineCore(
        config, model, model_max_len, device, dtype, pooler=setup.pooler, structured=structured,
        mirror=ranks,
    )
    info = engine_info(core, model, setup, source, architecture_of(hf_config), eos,
                       min(vocab_size(tokenizer), model.vocab_size))
    logger.info(
        "loaded %s (%s) on %s in %s in %.1fs; tasks %s%s",
        config.model.model, type(model).__name__, device, dtype,
        time.monotonic() - start, ", ".join(setup.tasks),
        "" if ranks is None else f"; {ranks.parallel.size} tensor-parallel ranks",
    )
    return LoadedEngine(core, info, tokenizer)


def _devices(core: EngineCore) -> str:
    """Where the model runs: "cuda:0", or "cuda:0-3" for ranks on four GPUs."""
    parallel = core.runner.parallel
    if parallel is None or not core.device.startswith("cuda:"):
        return core.device
    first = int(core.device.removeprefix("cuda:"))
    return f"{core.device}-{first + parallel.size - 1}"


def engine_info(
    core: EngineCore,
    model: CausalLM,
    setup: PoolingSetup,
    source: ModelSource,
    architecture: str,
    eos: frozenset[int],
    vocab: int,
) -> EngineInfo:
    caps = model.capabilities
    return EngineInfo(
        model_folder=str(source.folder),
        gguf_file=source.gguf_file,
        architecture=architecture,
        tasks=setup.tasks,
        max_model_len=core.max_model_len,
        vocab_size=vocab,
        logits_width=model.vocab_size,
        eos_token_ids=eos,
        device=_devices(core),
        dtype=core.compute_dtype,
        quantization=core.quantization,
        speculative=core.speculator.method if core.speculator is not None else "",
        kv_cache_dtype=core.kv_cache_dtype if core.num_kv_blocks else "",
        tensor_parallel_size=core.runner.parallel.size if core.runner.parallel else 1,
        num_kv_blocks=core.num_kv_blocks,
        block_size=core.config.cache.block_size,
        uses_token_types=model.type_vocab_size > 1,
        score_method=setup.score_method,
        labels=setup.labels,
        embedding_size=setup.embedding_size,
        max_input_len=setup.max_input_len,
        normalize=setup.normalize,
        prompts=setup.prompts,
        default_prompt_name=setup.default_prompt_name,
        pooler_tasks=setup.pooler_tasks,
        reads_images=caps.reads_images,
        embeds_images=caps.dual_encoder,
        uses_mrope=caps.uses_mrope,
        image_token_id=model.image_token_id,
        image_tokens=core.runner.vision.image_tokens if core.runner.vision is not None else None,
        pad_text_to=model.pad_text_to,
        pad_token_id=model.pad_token_id,
    )
