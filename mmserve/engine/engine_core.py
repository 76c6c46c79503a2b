"""The engine core: token ids in, token ids out, one step at a time."""

from __future__ import annotations

import logging

import torch

from mmserve.config import EngineConfig
from mmserve.engine.kv_cache_manager import KVCacheManager
from mmserve.engine.scheduler import Scheduler
from mmserve.models.base import CausalLM
from mmserve.outputs import EngineOutput
from mmserve.request import Request
from mmserve.runner.model_runner import ModelRunner
from mmserve.runner.pooler import Pooler

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler, the KV cache and the model runner of one model."""

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        model_max_len: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        pooler: Pooler | None = None,
    ) -> None:
        self.config = config
        cache = config.cache
        num_blocks = 0  # encoders keep no KV cache
        if getattr(model, "uses_kv_cache", True):
            num_blocks = cache.num_blocks or self._blocks_for_budget(model, kv_dtype)
        self.runner = ModelRunner(
            model, num_blocks, cache.block_size, device, kv_dtype, config.seed, pooler
        )
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        limit = config.model.max_model_len or model_max_len
        kv_limit = num_blocks * cache.block_size if num_blocks else model_max_len
        self.max_model_len = min(limit, model_max_len, kv_limit)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens), max_model_len %d",
            num_blocks, cache.block_size, num_blocks * cache.block_size, self.max_model_len,
        )

    def _blocks_for_budget(self, model: CausalLM, kv_dtype: torch.dtype) -> int:
        per_block = ModelRunner.kv_bytes_per_block(model, self.config.cache.block_size, kv_dtype)
        return max(1, self.config.cache.kv_cache_memory_bytes // per_block)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort(request_id)

    def stop(self, request_id: str) -> None:
        """The front end saw a stop string: end the request as stopped, free its blocks."""
        self.scheduler.finish_stopped(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[EngineOutput]:
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        return self.scheduler.update(plan, result)
