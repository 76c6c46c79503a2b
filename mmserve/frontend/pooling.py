"""Embed, Classify, Score and Rerank over one model, free of protobuf: the gRPC servicer calls
the async functions here on an AsyncFrontEnd, the offline LLM runs the same plans with run_sync.

Each call is planned first (mmserve.frontend.pooling_plans: the call's own checks), then its
inputs are encoded (checked, tokenised) a chunk at a time, each chunk going to the engine as
soon as it is encoded; each input runs as its own pooling request, so the items of one call
and of concurrent calls share engine steps under the token budget beside generation. An
input that fails its checks fails the call; what was already sent is aborted. A call keeps
at most MAX_IN_FLIGHT_PER_CALL requests in the engine at once and queues the rest, so a
large batch is split, never refused for its size up to MAX_INPUTS_PER_CALL inputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TypeVar

import torch

from mmserve.frontend.async_frontend import AsyncFrontEnd
from mmserve.frontend.frontend import FrontEnd, PooledResult
from mmserve.frontend.pooling_inputs import EncodedInput, TextOrIds
from mmserve.frontend.pooling_plans import (
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

MAX_IN_FLIGHT_PER_CALL = 256  # one call's requests in the engine at once (< AsyncFrontEnd's bound)
# smallest batch of a call's inputs sent to the engine at once while other requests are in
# it: a call of up to this many is tokenised in one Rust batch (parallel over the cores) and
# reaches the engine whole, one step when its tokens fit the budget. A call that finds the
# engine idle goes in chunks from IDLE_PIPELINE_MIN_CHUNK, so tokenising its second half
# overlaps the model's work on its first (H200, bert-base with encoder CUDA graphs, 64 x 128
# tokens: one client 10.7 ms per call in halves against 12.3 ms whole; four clients 9.0
# against 7.4 ms). In halves a 64 x 128 call takes 3.4-4 engine steps and two launches, whole
# two (the second only lands it; 2-core CPU, session 27). On the H200 again (session 28,
# scripts/embed_host.py --min-chunk 64): halves 9.18 ms a call, whole calls 9.70.
PIPELINE_MIN_CHUNK = 64
IDLE_PIPELINE_MIN_CHUNK = 32
T = TypeVar("T")


async def embed(
    engine: AsyncFrontEnd,
    inputs: Sequence[TextOrIds],
    *,
    normalize: bool | None = None,
    dimensions: int | None = None,
    truncate: str = "none",
    prompt_name: str | None = None,
) -> EmbedResult:
    """One vector per input (text or token ids). truncate: "none" | "left" | "right";
    normalize and prompt_name: as plan_embed says (None: the model's own defaults)."""
    plan = plan_embed(
        engine.frontend,
        inputs,
        normalize=normalize,
        dimensions=dimensions,
        truncate=truncate,
        prompt_name=prompt_name,
    )
    return await run_async(engine, plan)


async def classify(
    engine: AsyncFrontEnd, inputs: Sequence[TextOrIds], *, truncate: str = "none"
) -> ClassifyResult:
    """Label probabilities per input, all labels, highest first."""
    plan = plan_classify(engine.frontend, inputs, truncate=truncate)
    return await run_async(engine, plan)


async def score(
    engine: AsyncFrontEnd,
    first: Sequence[TextOrIds],
    second: Sequence[TextOrIds],
    *,
    truncate: str = "none",
) -> ScoreResult:
    """One score per item of `second`, against first[0] or pairwise (info.score_method says
    how: "cross-encoder", "cosine" or "yes-token")."""
    plan = plan_score(engine.frontend, first, second, truncate=truncate)
    return await run_async(engine, plan)


async def rerank(
    engine: AsyncFrontEnd,
    query: str,
    documents: Sequence[str],
    *,
    top_n: int | None = None,
    truncate: str = "none",
) -> RerankResult:
    """Documents by score against the query, highest first, at most top_n."""
    plan = plan_rerank(engine.frontend, query, documents, top_n=top_n, truncate=truncate)
    return await run_async(engine, plan)


async def run_async(engine: AsyncFrontEnd, plan: PoolingPlan[T]) -> T:
    """Encodes a plan's inputs a chunk at a time on the model's front-end threads and sends
    each chunk to the engine as one batch as soon as it is encoded, so tokenising the next
    chunk overlaps the engine's work on this one; at most MAX_IN_FLIGHT_PER_CALL inputs are
    in the engine at once. The first failure (an input's InvalidArgument included) fails the
    call and aborts what was sent; so does cancelling it."""
    size = chunk_size(plan.count, idle=engine.num_in_flight == 0)
    window = asyncio.Semaphore(max(MAX_IN_FLIGHT_PER_CALL // size, 1))
    tokens = 0

    async def one(items: list[EncodedInput]) -> list[torch.Tensor]:
        try:
            return [_pooled(d) for d in await engine.pool_batch(items, plan.params)]
        finally:
            window.release()

    tasks = []
    try:
        async with asyncio.TaskGroup() as group:
            for start in range(0, plan.count, size):
                await window.acquire()
                items = await engine.run(plan.encode, start, min(start + size, plan.count))
                tokens += sum(len(i.token_ids) for i in items)
                tasks.append(group.create_task(one(items)))
    except BaseExceptionGroup as errors:
        raise _first_leaf(errors) from None
    return plan.finish([pooled for t in tasks for pooled in t.result()], tokens)


def chunk_size(count: int, idle: bool = False) -> int:
    """Inputs per batch sent to the engine: a quarter of the call (so tokenising overlaps
    the engine), at least PIPELINE_MIN_CHUNK (IDLE_PIPELINE_MIN_CHUNK when the engine has
    nothing else to do; a call of up to that many goes whole), at most half the call's window."""
    quarter = -(-count // 4)
    least = IDLE_PIPELINE_MIN_CHUNK if idle else PIPELINE_MIN_CHUNK
    return max(1, min(max(least, quarter), MAX_IN_FLIGHT_PER_CALL // 2))


def run_sync(engine: FrontEnd, plan: PoolingPlan[T]) -> T:
    """Runs a plan on a synchronous engine (the offline API), stepping until all finish; on
    a failure the plan's other requests are aborted."""
    inputs = plan.encode()  # checked: the one validation of pooling inputs
    ids = {engine.new_request_id(): index for index in range(len(inputs))}
    pooled: list[torch.Tensor | None] = [None] * len(inputs)
    try:
        engine.add_pooling(
            [(rid, i.token_ids, i.token_type_ids, i.mm_inputs) for rid, i in zip(ids, inputs)],
            plan.params,
        )
        remaining = len(ids)
        while remaining:
            for news in engine.step():
                if isinstance(news, PooledResult) and news.request_id in ids:
                    pooled[ids[news.request_id]] = _pooled(news)
                    remaining -= 1
    except BaseException:
        for request_id in ids:
            engine.abort(request_id)
        raise
    tokens = sum(len(i.token_ids) for i in inputs)
    return plan.finish(pooled, tokens)  # type: ignore[arg-type]  # every slot is filled


def _pooled(result: PooledResult) -> torch.Tensor:
    out = result.output
    if out.pooled is None:
        raise RuntimeError(f"pooling request {result.request_id} failed: {out.error or out.finish_reason}")
    return out.pooled


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
