"""One record per RPC, and the interceptor that keeps it: the method, the model, the status
code and the timings, filled in by the flows as the call goes (generate.py, pooling.py,
servicer.py), then handed to the observers (metrics, the access log, tracing) when it ends.

The record of the running call is a context variable, set by the interceptor for the call's
task only (scoped: it is reset when the call ends); a flow run outside a server (tests) gets
a record nobody reads."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import grpc

Context: TypeAlias = grpc.aio.ServicerContext


@dataclass
class ChoiceRecord:
    """One Generate choice (one engine request): what the request-level metrics read."""

    queued: float  # time.monotonic() when it was handed to the engine
    scheduled: float | None = None  # the engine's first step for it
    first_token: float | None = None  # when its first token reached the server
    last_token: float | None = None  # ... its latest one
    output_tokens: int = 0
    finish_reason: str | None = None  # "stop", "length", "abort"; None: it never finished
    finished: float | None = None  # when it finished, or the call ended without it
    gaps: list[float] = field(default_factory=list)  # seconds between its token chunks
    text: list[str] = field(default_factory=list)  # its output, kept only with log_requests


@dataclass
class CallRecord:
    """One RPC, as the observers see it when it ends."""

    method: str  # "Generate", "Embed", ... ("Health/Check" for other services)
    service: str  # the full service name, e.g. "mmserve.v1.Inference"
    peer: str  # context.peer(), e.g. "ipv4:127.0.0.1:51234"
    start: float  # time.monotonic() when the call arrived
    metadata: tuple[tuple[str, str | bytes], ...] = ()  # the call's invocation metadata
    keep_text: bool = False  # log_requests: the prompt and outputs are kept for the log
    model: str = ""  # the served model's name once routed ("" before, or when unknown)
    task: str = ""  # "generate", "embed", "rerank", "classify", "score"; "" for the others
    request_id: str = ""  # the caller's (or generated) request id
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    output_tokens: int = 0
    pooling_inputs: int = 0  # engine requests of a pooling call
    choices: dict[int, ChoiceRecord] = field(default_factory=dict)  # Generate
    prompt: str | None = None  # kept only with log_requests
    code: grpc.StatusCode = grpc.StatusCode.OK  # once ended
    end: float = 0.0  # time.monotonic() when it ended

    @property
    def total_s(self) -> float:
        return self.end - self.start

    @property
    def ttft_s(self) -> float | None:
        """Seconds from the call's arrival to its first token (Generate)."""
        firsts = [c.first_token for c in self.choices.values() if c.first_token is not None]
        return min(firsts) - self.start if firsts else None

    def phase_s(self, phase: str) -> float | None:
        """Seconds choice 0 spent in a phase: "queue" (handed to the engine -> its first
        step), "prefill" (-> its first token) or "decode" (-> its last token)."""
        c = self.choices.get(0)
        if c is None:
            return None
        edges = {"queue": (c.queued, c.scheduled), "prefill": (c.scheduled, c.first_token),
                 "decode": (c.first_token, c.last_token)}  # fmt: skip
        a, b = edges[phase]
        return b - a if a is not None and b is not None else None

    def output_text(self) -> str:
        return "".join(t for _, c in sorted(self.choices.items()) for t in c.text)


_current: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar(
    "mmserve_call", default=None
)


def current() -> CallRecord:
    """The running call's record; outside a served call, a fresh one nobody reads."""
    return _current.get() or CallRecord("", "", "", time.monotonic())


class CallObserver(Protocol):
    """Told of each call as it starts and when it ends (metrics, access log, tracing)."""

    def started(self, record: CallRecord) -> None: ...

    def ended(self, record: CallRecord) -> None: ...


def status_of(exc: BaseException | None, context: Context) -> grpc.StatusCode:
    """The status a call ended with: its handler's, or CANCELLED / DEADLINE_EXCEEDED when the
    client went away (the task is cancelled), UNKNOWN for an exception grpc turns into it."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # GeneratorExit: closed early
        remaining = context.time_remaining()
        return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 \
            else grpc.StatusCode.CANCELLED
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # grpc.aio keeps the numeric code
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if exc is not None and not isinstance(exc, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.OK


class CallInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc has no stubs
    """Outermost in the chain: every call, refused or not, gets a record and reaches the
    observers once, with the code it ended with."""

    def __init__(self, observers: Sequence[CallObserver], keep_text: bool = False) -> None:
        self.observers = list(observers)
        self.keep_text = keep_text

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:  # unknown, or reflection: not observed
            return handler
        service, _, method = str(details.method).lstrip("/").rpartition("/")
        if not service.startswith("mmserve."):
            method = f"{service.rpartition('.')[2]}/{method}"  # e.g. Health/Check
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream, service, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if not inspect.iscoroutinefunction(handler.unary_unary):
            return handler  # a synchronous behaviour (none in this server)
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, service, method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    @contextmanager
    def _observed(self, service: str, method: str, context: Context) -> Iterator[None]:
        """The call's record set as the current one while the handler runs; the observers
        hear of its start, and of its end with the code it ended with."""
        record = CallRecord(
            method, service, str(context.peer() or ""), time.monotonic(),
            tuple(context.invocation_metadata() or ()), self.keep_text,
        )
        for observer in self.observers:
            observer.started(record)
        token = _current.set(record)
        error: BaseException | None = None
        try:
            yield
        except BaseException as e:
            error = e
            raise
        finally:
            _reset(token)
            record.code, record.end = status_of(error, context), time.monotonic()
            for observer in self.observers:
                observer.ended(record)

    def _unary(self, behaviour: Any, service: str, method: str) -> Any:
        async def call(request: Any, context: Context) -> Any:
            with self._observed(service, method, context):
                return await behaviour(request, context)

        return call

    def _streaming(self, behaviour: Any, service: str, method: str) -> Any:
        async def responses(request: Any, context: Context) -> AsyncIterator[Any]:
            with self._observed(service, method, context):
                stream = behaviour(request, context)
                if inspect.iscoroutine(stream):  # a refusal (the key check's) only aborts
                    await stream
                    return
                async with aclosing(stream):
                    async for response in stream:
                        yield response

        return responses


def _reset(token: contextvars.Token[CallRecord | None]) -> None:
    try:
        _current.reset(token)
    except ValueError:  # a stream closed from another context: that context never saw it
        pass
