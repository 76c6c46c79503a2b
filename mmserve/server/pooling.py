"""The Embed, Rerank, Classify and Score RPCs: proto -> the engine's pooling API -> proto.

Each call is planned (its own checks), then its inputs are tokenised and checked on the
model's front-end threads a chunk at a time, each chunk running as pooling requests on the model's shared engine
while the next is tokenised, beside whatever else the engine serves (generation included)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TypeVar

from mmserve.errors import EngineDead, InvalidArgument
from mmserve.frontend import pooling as pooling_api
from mmserve.frontend.pooling_plans import PoolingPlan
from mmserve.processors.images import ImageSource
from mmserve.server import calls, convert
from mmserve.server import convert_pooling as cp
from mmserve.server.errors import EngineFailed, engine_error
from mmserve.server.images import ImageInputs
from mmserve.server.models import ModelHandle
from mmserve_client.v1 import common_pb2, pooling_pb2

T = TypeVar("T")
OFF_LOOP_VALUES = 1 << 16  # responses with more embedding values are built on a worker thread


async def _run(handle: ModelHandle, plan: PoolingPlan[T]) -> tuple[T, float]:
    """The plan's result and when it was handed to the engine (time.monotonic())."""
    queued = time.monotonic()
    handle.require_serving()
    try:
        result = await pooling_api.run_async(handle.engine, plan)
        calls.current().pooling_inputs += plan.count
        return result, queued
    except EngineDead as e:
        raise engine_error(handle.name, e) from e
    except RuntimeError as e:  # a failed request
        raise EngineFailed(f"model {handle.name!r} failed the request: {e}") from e


def _timing(received: float, queued: float) -> common_pb2.Timing:
    return convert.timing(received, queued, None, time.monotonic())


async def embed(
    request: pooling_pb2.EmbedRequest,
    handle: ModelHandle,
    request_id: str,
    received: float,
    images: ImageInputs | None = None,
    namespace: str = "",
) -> pooling_pb2.EmbedResponse:
    """namespace: the caller's scope of image uuids (its tenant's)."""
    options = cp.embed_options(request)
    inputs = await _inputs(handle, "inputs", request.inputs, images, namespace)
    plan = pooling_api.plan_embed(
        handle.frontend,
        inputs,
        normalize=options.normalize,
        dimensions=options.dimensions,
        truncate=options.truncate,
        prompt_name=options.prompt_name,
    )
    result, queued = await _run(handle, plan)
    args = (result, options, request_id, handle.name, _timing(received, queued))
    if result.embeddings.numel() > OFF_LOOP_VALUES:
        return await handle.engine.run(cp.embed_response, *args)
    return cp.embed_response(*args)


async def _inputs(
    handle: ModelHandle,
    field: str,
    items: Sequence[common_pb2.Input],
    images: ImageInputs | None,
    namespace: str,
) -> list[Any]:
    """The request's `field` inputs as texts, token ids and images (decoded off the loop)."""
    inputs: list[Any] = cp.pooling_inputs(field, items, allow_images=True)
    at = [i for i, x in enumerate(inputs) if isinstance(x, ImageSource)]
    if not at:
        return inputs
    if images is None or not handle.facts.supports_images:
        raise InvalidArgument(f"{field}[{at[0]}].image", f"model {handle.name!r} does not embed images")
    sources = [(f"{field}[{i}].image", inputs[i]) for i in at]
    decoded = await images.load(sources, field, handle.engine, namespace, batch=True)
    for i, image in zip(at, decoded, strict=True):
        inputs[i] = image
    return inputs


async def rerank(
    request: pooling_pb2.RerankRequest, handle: ModelHandle, request_id: str, received: float
) -> pooling_pb2.RerankResponse:
    top_n = request.top_n if request.HasField("top_n") else None
    plan = pooling_api.plan_rerank(
        handle.frontend,
        request.query,
        list(request.documents),
        top_n=top_n,
        truncate=cp.truncate_mode(request.truncate),
    )
    result, queued = await _run(handle, plan)
    timing = _timing(received, queued)
    return cp.rerank_response(result, request.return_documents, request_id, handle.name, timing)


async def classify(
    request: pooling_pb2.ClassifyRequest, handle: ModelHandle, request_id: str, received: float
) -> pooling_pb2.ClassifyResponse:
    inputs = cp.pooling_inputs("inputs", request.inputs)
    plan = pooling_api.plan_classify(
        handle.frontend,
        inputs,
        truncate=cp.truncate_mode(request.truncate),
    )
    result, queued = await _run(handle, plan)
    return cp.classify_response(result, request_id, handle.name, _timing(received, queued))


async def score(
    request: pooling_pb2.ScoreRequest,
    handle: ModelHandle,
    request_id: str,
    received: float,
    images: ImageInputs | None = None,
    namespace: str = "",
) -> pooling_pb2.ScoreResponse:
    """Images may be scored where the model embeds them (cosine: CLIP, SigLIP)."""
    first = await _inputs(handle, "first", request.first, images, namespace)
    second = await _inputs(handle, "second", request.second, images, namespace)
    plan = pooling_api.plan_score(
        handle.frontend,
        first,
        second,
        truncate=cp.truncate_mode(request.truncate),
    )
    result, queued = await _run(handle, plan)
    return cp.score_response(result, request_id, handle.name, _timing(received, queued))
