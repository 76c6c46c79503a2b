"""Builds an LLMEngine from an EngineConfig: weights, tokenizer, KV cache."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.attention import get_attention_backend
from mmserve.config import EngineConfig
from mmserve.engine.engine_core import EngineCore
from mmserve.engine.multimodal import ImagePrompts
from mmserve.engine.pooling_setup import pooling_setup
from mmserve.models.base import CausalLM
from mmserve.models.gguf_cache import materialize
from mmserve.models.loader import load_model, resolve_device, resolve_dtype, resolve_model_source
from mmserve.models.registry import architecture_of
from mmserve.processors.tokenizer import eos_token_ids, load_tokenizer, vocab_size

if TYPE_CHECKING:
    from mmserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 4096  # when the config states no limit


def load_engine_parts(config: EngineConfig) -> LLMEngine:
    from mmserve.engine.llm_engine import LLMEngine

    if config.multiprocess:
        from mmserve.engine.core_proc import load_multiprocess_engine

        return load_multiprocess_engine(config)
    start = time.monotonic()
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    backend = get_attention_backend("triton" if device.type == "cuda" else "torch")
    source = materialize(resolve_model_source(config.model.model))
    model_config = replace(config.model, model=str(source.folder))
    model, hf_config, gen_config = load_model(model_config, device, dtype, backend)
    tokenizer = load_tokenizer(source.folder, source.gguf_file)
    # a model may know better than its config (XLM-R spends two positions on padding)
    model_max_len = (
        model.max_model_len
        or getattr(hf_config, "max_position_embeddings", None)
        or DEFAULT_MAX_MODEL_LEN
    )
    setup = pooling_setup(model, hf_config, source.folder, tokenizer, config.model.pooling)
    core = EngineCore(config, model, model_max_len, device, dtype, pooler=setup.pooler)
    eos = eos_token_ids(tokenizer, getattr(gen_config, "eos_token_id", None))
    vocab = min(vocab_size(tokenizer), model.vocab_size)
    logger.info(
        "loaded %s (%s) on %s in %s in %.1fs; tasks %s",
        config.model.model, type(model).__name__, device, dtype,
        time.monotonic() - start, ", ".join(setup.tasks),
    )
    images = image_prompts(model, source.folder)
    architecture = architecture_of(hf_config)
    return LLMEngine(core, tokenizer, frozenset(eos), vocab, setup, architecture, images)


def image_prompts(model: CausalLM, folder: Path) -> ImagePrompts | None:
    """The image front end of a model that reads images (its own image processor from
    preprocessor_config.json); None for text-only models."""
    if not model.capabilities.reads_images and not model.capabilities.dual_encoder:
        return None
    from mmserve.processors.image_processing import ImagePreprocessor

    return ImagePrompts(model, ImagePreprocessor.from_pretrained(folder))
