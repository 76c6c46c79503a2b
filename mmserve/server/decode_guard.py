"""Requests whose bytes do not decode as the method's request message (corrupt wire format,
bad UTF-8 in a string field): INVALID_ARGUMENT naming the message type, and a rate-limited
one-line warning.

Left to grpc, the deserializer's DecodeError escapes before any handler runs: grpc.aio logs
a full traceback and answers UNKNOWN "Unexpected <class ...>" on every such call, so garbage
floods the log. The interceptor wraps each handler's request_deserializer to return a
sentinel instead of raising, and its behaviour to abort on that sentinel."""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeAlias

import grpc
from google.protobuf import descriptor_pool

logger = logging.getLogger(__name__)
LOG_WINDOW_S = 60.0  # per method, at most one warning about undecodable requests this often
MAX_DETAIL_CHARS = 200  # of the parser's own message, in the log line

Context: TypeAlias = grpc.aio.ServicerContext


class _Undecodable:
    """What the guarded deserializer returns for bytes that do not decode."""

    def __repr__(self) -> str:
        return "UNDECODABLE"


UNDECODABLE = _Undecodable()


class RateLimitedLog:
    """At most one warning per `window_s` seconds per key; the warnings left out in between
    are counted and the next one reports how many."""

    def __init__(
        self, log: logging.Logger, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = log
        self._window_s = window_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str) -> None:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._window_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        left_out = self._suppressed.pop(key, 0)
        if left_out:
            message += f" ({left_out} more since the last report)"
        self._log.warning("%s", message)


@functools.lru_cache(maxsize=256)  # a handful of known methods: unknown ones never get here
def request_type_name(method: str) -> str | None:
    """The full name of a method's request message ('/pkg.Service/Method' ->
    'pkg.RequestType'), from the protos this process has imported; None if unknown."""
    service, _, name = method.lstrip("/").rpartition("/")
    try:
        found = descriptor_pool.Default().FindMethodByName(f"{service}.{name}")
    except KeyError:
        return None
    return str(found.input_type.full_name)


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc has no stubs
    """First in the chain: wraps every handler (the API key interceptor's refusals too, which
    never decode) so undecodable requests end INVALID_ARGUMENT."""

    def __init__(
        self, window_s: float = LOG_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = RateLimitedLog(logger, window_s, clock)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:  # unknown method, raw bytes
            return handler
        return guarded_handler(handler, details.method, self._log)


def _guarded_deserializer(
    decode: Callable[[bytes], Any], method: str, log: RateLimitedLog
) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return decode(raw)
        except Exception as e:  # noqa: BLE001 - whatever the parser raises, the bytes caused it
            detail = str(e)[:MAX_DETAIL_CHARS]
            log.warning(method, f"{method}: request does not decode: {type(e).__name__}: {detail}")
            return UNDECODABLE

    return deserialize


def guarded_handler(
    handler: grpc.RpcMethodHandler, method: str, log: RateLimitedLog
) -> grpc.RpcMethodHandler:
    """`handler` with its deserializer guarded and its behaviour aborting INVALID_ARGUMENT on
    an undecodable request. Synchronous behaviours (none in this server) are left as they are."""
    name = request_type_name(method)
    message = f"request is not a valid {name}" if name else f"request of {method} does not decode"
    shapes = {
        (False, False): (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
        (False, True): (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (True, False): (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (True, True): (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
    }
    behaviour, make = shapes[(handler.request_streaming, handler.response_streaming)]
    guarded = _guard(behaviour, handler.request_streaming, message)
    if guarded is None:
        return handler
    return make(
        guarded,
        request_deserializer=_guarded_deserializer(handler.request_deserializer, method, log),
        response_serializer=handler.response_serializer,
    )


async def _abort(context: Context, message: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


async def _checked(requests: AsyncIterator[Any], context: Context, message: str) -> Any:
    """A request stream that ends the call at its first undecodable message."""
    async for request in requests:
        if request is UNDECODABLE:
            await _abort(context, message)
        yield request


def _guard(behaviour: Any, streaming_request: bool, message: str) -> Any:
    """The behaviour wrapped in the same calling convention grpc.aio inspects for: a
    coroutine function (unary response, or the reader/writer API) or an async generator."""

    async def first(request: Any, context: Context) -> Any:
        """The request the behaviour gets: a checked stream, or the decoded message."""
        if streaming_request:
            return _checked(request, context, message)
        if request is UNDECODABLE:
            await _abort(context, message)
        return request

    if inspect.isasyncgenfunction(behaviour):

        async def responses(request: Any, context: Context) -> AsyncIterator[Any]:
            # aclosing: when grpc stops iterating, the behaviour's cleanup runs at once.
            async with aclosing(behaviour(await first(request, context), context)) as stream:
                async for response in stream:
                    yield response

        return responses
    if inspect.iscoroutinefunction(behaviour):

        async def call(request: Any, context: Context) -> Any:
            return await behaviour(await first(request, context), context)

        return call
    return None
