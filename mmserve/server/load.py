"""The WatchLoad RPC: each model's load as its engine's latest step left it (EngineStats),
streamed for routers and client-side load balancers. The same numbers feed the metrics
(mmserve:num_requests_running, ...), so a report and a scrape taken together agree."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from mmserve.server.admission import Admission
from mmserve.server.models import ModelHandle, ModelRegistry
from mmserve_client.v1 import load_pb2

DEFAULT_INTERVAL_MS = 1000
MIN_INTERVAL_MS = 100  # a report costs a few microseconds per model, but not 0


def model_load(handle: ModelHandle, admission: Admission) -> load_pb2.ModelLoad:
    s = handle.engine.stats()
    return load_pb2.ModelLoad(
        model=handle.name,
        running=s.num_running,
        waiting=s.num_waiting,
        kv_usage=s.kv_usage,
        free_blocks=s.num_free_blocks,
        total_blocks=s.num_blocks,
        prefix_hit_rate=s.prefix_hit_rate,
        tokens_in_flight=s.tokens_in_flight,
        calls_in_flight=admission.in_flight_of(handle.name),
        serving=handle.dead is None,
    )


def load_report(
    handles: list[ModelHandle], admission: Admission, request_id: str = ""
) -> load_pb2.WatchLoadResponse:
    return load_pb2.WatchLoadResponse(
        models=[model_load(h, admission) for h in handles],
        calls_in_flight=admission.in_flight,
        draining=admission.draining,
        request_id=request_id,
    )


async def watch(
    request: load_pb2.WatchLoadRequest,
    registry: ModelRegistry,
    admission: Admission,
    request_id: str = "",
) -> AsyncGenerator[load_pb2.WatchLoadResponse, None]:
    """A report now, then one per interval until the client leaves; draining, one last
    report says so and the stream ends. An unknown model is InvalidArgument (registry).
    request_id: echoed on every report."""
    handles = [registry.get(request.model)] if request.model else list(registry)
    interval = max(request.interval_ms or DEFAULT_INTERVAL_MS, MIN_INTERVAL_MS) / 1000
    while True:
        report = load_report(handles, admission, request_id)
        yield report
        if report.draining:
            return
        await asyncio.sleep(interval)
