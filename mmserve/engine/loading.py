"""Builds an engine core from an EngineConfig (weights, tokenizer facts, KV cache) and the
EngineInfo it answers to the layers above."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from mmserve.attention import get_attention_backend
from mmserve.config import EngineConfig
from mmserve.engine.engine_core import EngineCore
from mmserve.engine.messages import EngineInfo
from mmserve.engine.pooling_setup import PoolingSetup, pooling_setup
from mmserve.models.base import CausalLM
from mmserve.models.gguf_cache import materialize
from mmserve.models.loader import (
    ModelSource,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_model_source,
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
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    backend = get_attention_backend("triton" if device.type == "cuda" else "torch")
    # the converted folder's config and tokenizer; load_model reads the weights (a GGUF's
    # dequantised ones from that folder, or, on CUDA, its blocks from the file itself)
    source = materialize(resolve_model_source(config.model.model), weights=False)
    model, hf_config, gen_config = load_model(config.model, device, dtype, backend)
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
        config, model, model_max_len, device, dtype, pooler=setup.pooler, structured=structured
    )
    info = engine_info(core, model, setup, source, architecture_of(hf_config), eos,
                       min(vocab_size(tokenizer), model.vocab_size))
    logger.info(
        "loaded %s (%s) on %s in %s in %.1fs; tasks %s",
        config.model.model, type(model).__name__, device, dtype,
        time.monotonic() - start, ", ".join(setup.tasks),
    )
    return LoadedEngine(core, info, tokenizer)


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
        device=core.device,
        dtype=core.compute_dtype,
        quantization=core.quantization,
        speculative=core.speculator.method if core.speculator is not None else "",
        kv_cache_dtype=core.kv_cache_dtype if core.num_kv_blocks else "",
        num_kv_blocks=core.num_kv_blocks,
        block_size=core.config.cache.block_size,
        uses_token_types=model.type_vocab_size > 1,
        score_method=setup.score_method,
        labels=setup.labels,
        embedding_size=setup.embedding_size,
        max_input_len=setup.max_input_len,
        pooler_tasks=setup.pooler_tasks,
        reads_images=caps.reads_images,
        embeds_images=caps.dual_encoder,
        uses_mrope=caps.uses_mrope,
        image_token_id=model.image_token_id,
        image_tokens=core.runner.vision.image_tokens if core.runner.vision is not None else None,
        pad_text_to=model.pad_text_to,
        pad_token_id=model.pad_token_id,
    )
