"""The mmserve.v1.Inference service: routing, admission and error mapping around the flows
of generate.py, pooling.py and tokens.py. Proto <-> dataclass conversion lives in convert.py
and convert_pooling.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeAlias, TypeVar

import grpc

from mmserve.server import calls, generate, load, pooling, tokens
from mmserve.server.admission import Admission
from mmserve.server.auth import ApiKeyInterceptor
from mmserve.server.config import ServerConfig
from mmserve.server.convert import model_info
from mmserve.server.errors import abort, within_limit
from mmserve.server.images import ImageInputs
from mmserve.server.models import ModelHandle, ModelRegistry, Task
from mmserve_client.v1 import (
    generate_pb2,
    inference_pb2_grpc,
    load_pb2,
    models_pb2,
    pooling_pb2,
    tokenize_pb2,
)

R = TypeVar("R")
Context: TypeAlias = grpc.aio.ServicerContext


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Each RPC: find the model for its task, take an admission slot, run the flow; any
    failure becomes the status API.md's error table gives it."""

    def __init__(
        self,
        registry: ModelRegistry,
        config: ServerConfig,
        admission: Admission,
        tenants: ApiKeyInterceptor | None = None,
    ) -> None:
        """tenants: the API keys, when each key's tenant gets caches of its own."""
        self.registry = registry
        self.config = config
        self.admission = admission
        self.images = ImageInputs(config)  # limits, media dir and uuids of image inputs
        self.tenants = tenants

    def _scope(self, context: Context) -> str:
        """The call's tenant ("" when tenants share): the namespace of its image uuids and,
        joined to its cache_salt, of its prefix-cache blocks."""
        if self.tenants is None:
            return ""
        return self.tenants.tenant(context.invocation_metadata()) or ""

    async def _unary(
        self,
        context: Context,
        model: str,
        task: Task | None,
        flow: Callable[[ModelHandle], Awaitable[R]],
        request_id: str,
    ) -> R:
        record = calls.current()
        record.request_id = request_id
        try:
            handle = self.registry.get(model, task)
            _routed(record, handle, task)
            with self.admission.slot(handle.name):
                response = await flow(handle)
            if "usage" in response.DESCRIPTOR.fields_by_name:  # type: ignore[attr-defined]
                record.prompt_tokens = response.usage.prompt_tokens  # type: ignore[attr-defined]
            return within_limit(response, self.config.max_message_bytes)
        except Exception as e:  # noqa: BLE001 - the call's error boundary: every error -> a status
            await abort(context, e, self.config.retry_after_s)

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        record = calls.current()
        received, record.request_id = record.start, request.request_id
        scope = self._scope(context)
        if scope:  # another tenant's blocks never match: the salt is part of every block hash
            request.cache_salt = f"{scope}\x1f{request.cache_salt}"
        try:
            handle = self.registry.get(request.model, Task.GENERATE)
            _routed(record, handle, Task.GENERATE)
            with self.admission.slot(handle.name):
                prep = await generate.prepare(
                    request, handle, self.config, received, self.images
                )
                record.request_id = prep.request_id
                record.prompt_tokens = len(prep.job.prompt_token_ids)
                if record.keep_text:
                    record.prompt = generate.prompt_text(request)
                # aclosing: a chunk over the limit ends the stream, and the request, at once
                async with aclosing(generate.stream(prep)) as chunks:
                    async for chunk in chunks:
                        yield within_limit(chunk, self.config.max_message_bytes)
        except Exception as e:  # noqa: BLE001 - CancelledError (client gone, deadline) passes
            await abort(context, e, self.config.retry_after_s)

    async def Tokenize(
        self, request: tokenize_pb2.TokenizeRequest, context: Context
    ) -> tokenize_pb2.TokenizeResponse:
        rid, scope = _request_id(request), self._scope(context)
        return await self._unary(
            context, request.model, None,
            lambda h: tokens.tokenize(request, h, rid, self.images, scope), rid,
        )

    async def Detokenize(
        self, request: tokenize_pb2.DetokenizeRequest, context: Context
    ) -> tokenize_pb2.DetokenizeResponse:
        rid = _request_id(request)
        return await self._unary(
            context, request.model, None, lambda h: tokens.detokenize(request, h, rid), rid
        )

    async def ListModels(
        self, request: models_pb2.ListModelsRequest, context: Context
    ) -> models_pb2.ListModelsResponse:
        try:
            self.admission.check_open()
            handles = [self.registry.get(request.model)] if request.model else list(self.registry)
        except Exception as e:  # noqa: BLE001 - the call's error boundary
            await abort(context, e, self.config.retry_after_s)
        return models_pb2.ListModelsResponse(
            request_id=_request_id(request), models=[model_info(h) for h in handles]
        )

    async def WatchLoad(
        self, request: load_pb2.WatchLoadRequest, context: Context
    ) -> AsyncIterator[load_pb2.WatchLoadResponse]:
        """Holds no admission slot: a router's long-lived stream never blocks a drain or
        takes a model's place; it ends by itself once the server drains."""
        rid = calls.current().request_id = _request_id(request)
        try:
            watch = load.watch(request, self.registry, self.admission, rid)
            async with aclosing(watch) as reports:
                async for report in reports:
                    yield report
        except Exception as e:  # noqa: BLE001 - the call's error boundary
            await abort(context, e, self.config.retry_after_s)

    async def Embed(
        self, request: pooling_pb2.EmbedRequest, context: Context
    ) -> pooling_pb2.EmbedResponse:
        rid, received, scope = _request_id(request), time.monotonic(), self._scope(context)
        return await self._unary(
            context, request.model, Task.EMBED,
            lambda h: pooling.embed(request, h, rid, received, self.images, scope), rid,
        )

    async def Rerank(
        self, request: pooling_pb2.RerankRequest, context: Context
    ) -> pooling_pb2.RerankResponse:
        rid, received = _request_id(request), time.monotonic()
        return await self._unary(
            context, request.model, Task.RERANK,
            lambda h: pooling.rerank(request, h, rid, received), rid,
        )

    async def Classify(
        self, request: pooling_pb2.ClassifyRequest, context: Context
    ) -> pooling_pb2.ClassifyResponse:
        rid, received = _request_id(request), time.monotonic()
        return await self._unary(
            context,
            request.model,
            Task.CLASSIFY,
            lambda h: pooling.classify(request, h, rid, received),
            rid,
        )

    async def Score(
        self, request: pooling_pb2.ScoreRequest, context: Context
    ) -> pooling_pb2.ScoreResponse:
        rid, received, scope = _request_id(request), time.monotonic(), self._scope(context)
        return await self._unary(
            context, request.model, Task.SCORE,
            lambda h: pooling.score(request, h, rid, received, self.images, scope), rid,
        )


def _routed(record: calls.CallRecord, handle: ModelHandle, task: Task | None) -> None:
    """The call's model and task, once its model is known: labels come from served names
    only, never from what a request asked for."""
    record.model, record.task = handle.name, task.value if task is not None else ""


def _request_id(request: Any) -> str:
    return str(request.request_id) or uuid.uuid4().hex
