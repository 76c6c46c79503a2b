"""The grpc.aio server: the Inference service, standard health and reflection, API keys,
TLS, message limits, and a draining shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from mmserve.errors import EngineStalled
from mmserve.heap import freeze_heap
from mmserve.server.access_log import AccessLog
from mmserve.server.admission import Admission
from mmserve.server.auth import ApiKeyInterceptor, load_api_keys
from mmserve.server.calls import CallInterceptor, CallObserver
from mmserve.server.config import ServerConfig
from mmserve.server.decode_guard import DecodeGuardInterceptor
from mmserve.server.metrics import Metrics, serve_metrics
from mmserve.server.models import ModelHandle, ModelRegistry
from mmserve.server.servicer import InferenceServicer
from mmserve.server.tracing import Tracing
from mmserve_client.v1 import inference_pb2, inference_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
HEALTH_POLL_S = 0.5  # how often engine liveness is mirrored into health
# A drain keeps refusing calls (UNAVAILABLE, which clients retry on another replica) at least
# this long (within the grace) before the gRPC server stops: clients' health watches learn
# NOT_SERVING meanwhile. A call that reaches a stopping gRPC server before a handler takes it is
# CANCELLED (grpc/grpc#41785), which no client retries; seen when the server stopped 13 ms after
# NOT_SERVING, three callers on two replicas, a loaded 2-core machine.
DRAIN_SETTLE_S = 0.5
RESTARTS, RESTART_WINDOW_S = 3, 600.0  # a model's engine restarts at most this often
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS from PEM files; with tls_client_ca, clients must present a certificate (mTLS)."""
    if not config.tls or config.tls_cert is None or config.tls_key is None:
        return None
    pair = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
    ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=ca is not None
    )


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class MMServer:
    """One server process's gRPC side. start() binds and serves; drain() refuses new calls,
    lets running ones finish (up to shutdown_grace), then stops."""

    def __init__(
        self, registry: ModelRegistry, config: ServerConfig, tracer_provider: Any = None
    ) -> None:
        """tracer_provider: an OpenTelemetry TracerProvider to trace with (tests); by default
        one exporting to config.otlp_traces_endpoint, when set."""
        self.registry = registry
        self.config = config
        self.metrics: Metrics | None = Metrics(registry) if config.metrics_port is not None else None
        self.metrics_port: int | None = None  # the bound metrics port, once started
        self._metrics_server: WSGIServer | None = None
        self.tracing = self._tracing(tracer_provider)
        self.admission = Admission(config.max_pending)
        self.health = HealthServicer()
        self.port: int | None = None  # the bound port, once started
        self._server: grpc.aio.Server | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._restarts: dict[str, list[float]] = {}  # model -> time.monotonic() of restarts

    def _tracing(self, provider: Any) -> Tracing | None:
        if provider is not None:
            return Tracing(provider)
        endpoint = self.config.otlp_traces_endpoint
        return Tracing.start(endpoint) if endpoint else None

    def _observers(self) -> list[CallObserver]:
        """Who hears of every call's end: the access log always, metrics and tracing when on."""
        observers: list[CallObserver] = [AccessLog(self.config.log_requests)]
        if self.metrics is not None:
            observers.append(self.metrics)
        if self.tracing is not None:
            observers.append(self.tracing)
        return observers

    def _build(self) -> grpc.aio.Server:
        keys = load_api_keys(self.config.api_key_file) if self.config.api_key_file else None
        auth = ApiKeyInterceptor(keys) if keys else None
        limit = self.config.max_message_bytes
        # The call records come first so every call is seen, refused ones too; then the decode
        # guard, so it wraps every handler, the key check's refusals too; those never decode,
        # so a caller without a key gets UNAUTHENTICATED whatever it sent.
        interceptors: list[grpc.aio.ServerInterceptor] = [
            CallInterceptor(self._observers(), keep_text=self.config.log_requests),
            DecodeGuardInterceptor(),
        ]
        if auth:
            interceptors.append(auth)
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
                ("grpc.so_reuseport", 0),  # a port already in use is an error, not shared
            ],
        )
        tenants = auth if auth and not self.config.share_prefix_cache_across_keys else None
        servicer = InferenceServicer(self.registry, self.config, self.admission, tenants)
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)
        return server

    async def start(self) -> int:
        """Binds, starts serving and marks every model SERVING; returns the port."""
        self._server = server = self._build()
        address = _address(self.config.host, self.config.port)
        creds = server_credentials(self.config)
        try:
            port: int = (
                server.add_secure_port(address, creds)
                if creds
                else server.add_insecure_port(address)
            )
        except RuntimeError as e:  # grpc's way of saying "in use" or "no such address"
            raise OSError(f"cannot listen on {address}: port in use or bad host") from e
        await server.start()
        self.port = port
        if self.metrics is not None and self.config.metrics_port is not None:
            self._metrics_server, self.metrics_port = serve_metrics(
                self.metrics.registry, self.config.host, self.config.metrics_port
            )
        for name in ("", SERVICE_NAME, *self.registry.names):
            await self.health.set(name, SERVING)
        self._watchdog = asyncio.create_task(self._watch_engines())
        mode = "mTLS" if self.config.tls_client_ca else "TLS" if creds else "plaintext"
        auth = "API keys required" if self.config.api_key_file else "no API keys"
        logger.info(
            "listening on %s (%s, %s), models: %s",
            _address(self.config.host, port),
            mode,
            auth,
            ", ".join(self.registry.names),
        )
        freeze_heap()  # the server's start-up objects too (mmserve.heap)
        return port

    async def _watch_engines(self) -> None:
        """A dead engine turns its model, and the server overall, NOT_SERVING; so does one
        that has had work without a step for engine_stall_timeout (declared dead: its calls
        fail UNAVAILABLE). An idle engine's process is checked too (AsyncFrontEnd). With
        restart_dead_engines, a dead engine is started again (RESTARTS per RESTART_WINDOW_S)."""
        down: set[str] = set()  # models reported NOT_SERVING (restarting, or for good)
        limit = self.config.engine_stall_timeout
        while True:
            for handle in self.registry:
                stalled = handle.engine.stalled_for()
                if handle.dead is None and stalled > limit:
                    handle.engine.fail(EngineStalled(f"engine stalled: no step for {stalled:.0f}s"))
                if handle.dead is not None and handle.name not in down:
                    down.add(handle.name)
                    logger.error("model %r: engine is dead: %s", handle.name, handle.dead)
                    await self._set_health(handle.name, NOT_SERVING)
                    if self._may_restart(handle):
                        asyncio.create_task(self._restart(handle, down))
            await asyncio.sleep(HEALTH_POLL_S)

    async def _set_health(self, name: str, status: int) -> None:
        """A model's status; the server's overall status is SERVING while every model is."""
        await self.health.set(name, status)
        overall = SERVING if all(h.dead is None for h in self.registry) else NOT_SERVING
        await self.health.set("", overall)
        await self.health.set(SERVICE_NAME, overall)

    def _may_restart(self, handle: ModelHandle) -> bool:
        if not (self.config.restart_dead_engines and handle.restartable):
            return False
        now = time.monotonic()
        recent = [t for t in self._restarts.get(handle.name, []) if now - t < RESTART_WINDOW_S]
        self._restarts[handle.name] = recent
        if len(recent) >= RESTARTS:
            logger.error("model %r: %d restarts in %.0fs: it stays down", handle.name, RESTARTS, RESTART_WINDOW_S)
            return False
        recent.append(now)
        return True

    async def _restart(self, handle: ModelHandle, down: set[str]) -> None:
        logger.warning("model %r: starting its engine again", handle.name)
        try:
            await asyncio.to_thread(handle.restart)
        except Exception:
            logger.exception("model %r: the restart failed; it stays down", handle.name)
            return
        if self.admission.draining:
            return
        logger.info("model %r: engine restarted, serving again", handle.name)
        down.discard(handle.name)
        await self._set_health(handle.name, SERVING)

    async def drain(self, grace: float | None = None) -> None:
        """Refuses new calls (UNAVAILABLE), waits for running ones up to `grace` seconds (and
        at least DRAIN_SETTLE_S of it), cancels what is left, and stops the engines."""
        grace = self.config.shutdown_grace if grace is None else grace
        start = time.monotonic()
        self.admission.draining = True
        await self.health.enter_graceful_shutdown()
        logger.info("draining: %d calls in flight, up to %.0fs", self.admission.in_flight, grace)
        if not await self.admission.wait_idle(grace):
            logger.warning("grace period over: cancelling %d calls", self.admission.in_flight)
        settle = min(grace, DRAIN_SETTLE_S) - (time.monotonic() - start)
        if settle > 0:
            await asyncio.sleep(settle)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._server is not None:
            await self._server.stop(max(0.0, grace - (time.monotonic() - start)) or None)
        await asyncio.to_thread(self.registry.shutdown)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)
        logger.info("stopped")


async def serve(registry: ModelRegistry, config: ServerConfig) -> None:
    """Serves until SIGTERM or SIGINT, then drains."""
    server = MMServer(registry, config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("signal received: shutting down")
    await server.drain()
