"""Embed, Classify, Score and Rerank over one engine, free of protobuf: the gRPC servicer calls
the async functions here on an AsyncEngine, the offline LLM runs the same plans with run_sync.

Each call is planned first (mmserve.engine.pooling_plans: every InvalidArgument is raised
before anything reaches the engine), then each input runs as its own pooling request, so the
items of one call and of concurrent calls share engine steps under the token budget beside
generation. A call keeps at most MAX_IN_FLIGHT_PER_CALL requests in the engine at once, sent
in batches, and queues the rest, so a large batch is split, never refused for its size up to
MAX_INPUTS_PER_CALL inputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from mmserve.engine.async_engine import PoolInput
from mmserve.engine.pooling_inputs import EncodedInput, TextOrIds
from mmserve.engine.pooling_plans import (
    MAX_INPUTS_PER_CALL,
    Classification,
    ClassifyResult,
    EmbedResult,
    LabelScore,
    PoolingPlan,
    RankedDocument,
    RerankResult,
    ScoreResult,
    plan_classify,
    plan_embed,
    plan_rerank,
    plan_score,
)

if TYPE_CHECKING:
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.engine.llm_engine import GenerationDelta, LLMEngine

__all__ = [
    "MAX_INPUTS_PER_CALL",
    "MAX_IN_FLIGHT_PER_CALL",
    "Classification",
    "ClassifyResult",
    "EmbedResult",
    "LabelScore",
    "PoolingPlan",
    "RankedDocument",
    "RerankResult",
    "ScoreResult",
    "classify",
    "embed",
    "plan_classify",
    "plan_embed",
    "plan_rerank",
    "plan_score",
    "rerank",
    "run_async",
    "run_sync",
    "score",
]

MAX_IN_FLIGHT_PER_CALL = 256  # one call's requests in the engine at once (< AsyncEngine's bound)
T = TypeVar("T")


async def embed(
    engine: AsyncEngine,
    inputs: Sequence[TextOrIds],
    *,
    normalize: bool = True,
    dimensions: int | None = None,
    truncate: str = "none",
) -> EmbedResult:
    """One vector per input (text or token ids). truncate: "none" | "left" | "right"."""
    plan = await asyncio.to_thread(
        plan_embed,
        engine.engine,
        inputs,
        normalize=normalize,
        dimensions=dimensions,
        truncate=truncate,
    )
    return await run_async(engine, plan)


async def classify(
    engine: AsyncEngine, inputs: Sequence[TextOrIds], *, truncate: str = "none"
) -> ClassifyResult:
    """Label probabilities per input, all labels, highest first."""
    plan = await asyncio.to_thread(plan_classify, engine.engine, inputs, truncate=truncate)
    return await run_async(engine, plan)


async def score(
    engine: AsyncEngine,
    first: Sequence[TextOrIds],
    second: Sequence[TextOrIds],
    *,
    truncate: str = "none",
) -> ScoreResult:
    """One score per item of `second`, against first[0] or pairwise (engine.setup.score_method
    says how: "cross-encoder", "cosine" or "yes-token")."""
    plan = await asyncio.to_thread(plan_score, engine.engine, first, second, truncate=truncate)
    return await run_async(engine, plan)


async def rerank(
    engine: AsyncEngine,
    query: str,
    documents: Sequence[str],
    *,
    top_n: int | None = None,
    truncate: str = "none",
) -> RerankResult:
    """Documents by score against the query, highest first, at most top_n."""
    plan = await asyncio.to_thread(
        plan_rerank, engine.engine, query, documents, top_n=top_n, truncate=truncate
    )
    return await run_async(engine, plan)


async def run_async(engine: AsyncEngine, plan: PoolingPlan[T]) -> T:
    """Runs a plan's requests in batches of MAX_IN_FLIGHT_PER_CALL // 2, two batches in the
    engine at a time (each batch reaches the engine as one command, so its inputs share
    steps). The first failure fails the call and aborts the rest; so does cancelling it."""
    size = max(MAX_IN_FLIGHT_PER_CALL // 2, 1)
    window = asyncio.Semaphore(2)

    async def one(items: Sequence[EncodedInput]) -> list[torch.Tensor]:
        inputs = [PoolInput(i.token_ids, i.token_type_ids, i.mm_inputs) for i in items]
        async with window:
            return [_pooled(d) for d in await engine.pool_batch(inputs, plan.params)]

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(one(plan.inputs[i : i + size]))
                for i in range(0, len(plan.inputs), size)
            ]
    except BaseExceptionGroup as errors:
        raise _first_leaf(errors) from None
    return plan.finish([pooled for t in tasks for pooled in t.result()])


def run_sync(engine: LLMEngine, plan: PoolingPlan[T]) -> T:
    """Runs a plan on a synchronous engine (the offline API), stepping until all finish; on
    a failure the plan's other requests are aborted."""
    ids: dict[str, int] = {}  # request id -> input index
    pooled: list[torch.Tensor | None] = [None] * len(plan.inputs)
    try:
        for index, item in enumerate(plan.inputs):
            request_id = engine.new_request_id()
            engine.add_pooling_request(
                request_id, item.token_ids, plan.params, item.token_type_ids, item.mm_inputs
            )
            ids[request_id] = index
        remaining = len(ids)
        while remaining:
            for delta in engine.step():
                if delta.request_id in ids:
                    pooled[ids[delta.request_id]] = _pooled(delta)
                    remaining -= 1
    except BaseException:
        for request_id in ids:
            engine.abort(request_id)
        raise
    return plan.finish(pooled)  # type: ignore[arg-type]  # every slot is filled


def _pooled(delta: GenerationDelta) -> torch.Tensor:
    if delta.pooled is None:
        reason = delta.error or delta.finish_reason
        raise RuntimeError(f"pooling request {delta.request_id} failed: {reason}")
    pooled: torch.Tensor = delta.pooled
    return pooled


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
