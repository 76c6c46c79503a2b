"""OpenTelemetry tracing, optional (`pip install mmserve[otel]`): one SERVER span per RPC,
its parent the W3C `traceparent` (and `tracestate`) of the call's metadata, its attributes
the model, the request id, the prompt / cached / output tokens and the queue, prefill and
decode times. Without the extra installed, `Tracing.start` logs one warning and the server
runs as it would without --otlp-traces-endpoint."""

from __future__ import annotations

import logging
from typing import Any

import grpc

from mmserve.server.calls import CallRecord

logger = logging.getLogger(__name__)
TRACER_NAME = "mmserve"
PROPAGATED = ("traceparent", "tracestate")  # the W3C trace-context metadata keys


class Tracing:
    """A CallObserver that opens a span when a call starts and ends it with the call."""

    def __init__(self, provider: Any) -> None:
        """provider: an opentelemetry.sdk.trace.TracerProvider (tests pass one with an
        in-memory exporter)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = provider.get_tracer(TRACER_NAME)
        self._provider = provider
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._status, self._error = SpanKind.SERVER, Status, StatusCode.ERROR
        self._spans: dict[int, Any] = {}  # id(record) -> its open span

    @classmethod
    def start(cls, endpoint: str) -> Tracing | None:
        """Spans batched to the OTLP/gRPC collector at `endpoint`; None (and a warning) when
        the otel extra is not installed."""
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            logger.warning(
                "--otlp-traces-endpoint needs the otel extra (pip install 'mmserve[otel]'): "
                "%s; serving without tracing", e,
            )
            return None
        provider = TracerProvider(resource=Resource.create({"service.name": "mmserve"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        logger.info("tracing: OTLP spans to %s", endpoint)
        return cls(provider)

    def started(self, record: CallRecord) -> None:
        carrier = {}
        for key, value in record.metadata:
            if key in PROPAGATED and isinstance(value, str):
                carrier[key] = value
        parent = self._propagator.extract(carrier) if carrier else None
        name = f"{record.service}/{record.method.rpartition('/')[2]}"
        self._spans[id(record)] = self._tracer.start_span(
            name, context=parent, kind=self._kind, start_time=None,
            attributes={"rpc.system": "grpc", "rpc.service": record.service,
                        "rpc.method": record.method.rpartition("/")[2]},
        )  # fmt: skip

    def ended(self, record: CallRecord) -> None:
        span = self._spans.pop(id(record), None)
        if span is None:
            return
        span.set_attributes(span_attributes(record))
        if record.code != grpc.StatusCode.OK:
            span.set_status(self._status(self._error, record.code.name))
        span.end()

    def shutdown(self) -> None:
        """Sends what is buffered, then stops (on drain)."""
        shutdown = getattr(self._provider, "shutdown", None)
        if callable(shutdown):
            shutdown()


def span_attributes(record: CallRecord) -> dict[str, Any]:
    """The call's facts as span attributes (OpenTelemetry's gen_ai names, as vLLM sets them);
    times in seconds, left out when the call had no such phase."""
    attributes: dict[str, Any] = {
        "rpc.grpc.status_code": record.code.value[0],
        "gen_ai.request.model": record.model,
        "gen_ai.request.id": record.request_id,
        "gen_ai.usage.prompt_tokens": record.prompt_tokens,
        "gen_ai.usage.cached_tokens": record.cached_tokens,
        "gen_ai.usage.completion_tokens": record.output_tokens,
        "gen_ai.latency.e2e": record.total_s,
    }
    phases = {
        "gen_ai.latency.time_in_queue": record.phase_s("queue"),
        "gen_ai.latency.time_to_first_token": record.ttft_s,
        "gen_ai.latency.time_in_model_prefill": record.phase_s("prefill"),
        "gen_ai.latency.time_in_model_decode": record.phase_s("decode"),
    }
    attributes.update({k: v for k, v in phases.items() if v is not None})
    return attributes
