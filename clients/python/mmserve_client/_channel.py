"""Channel settings shared by Client and AsyncClient: retries, message limits, auth metadata."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from typing import Any

import grpc

from mmserve_client._requests import GenerateKwargs, generate_request
from mmserve_client.v1 import inference_pb2, inference_pb2_grpc, load_pb2

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
"""The service descriptor (full name "mmserve.v1.Inference")."""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Default send/receive limit per message: room for batches of images and packed vectors."""

IDEMPOTENT_METHODS = (
    "Embed",
    "Rerank",
    "Classify",
    "Score",
    "Tokenize",
    "Detokenize",
    "ListModels",
    "WatchLoad",
)
"""RPCs that gRPC may retry on UNAVAILABLE whenever it comes (WatchLoad's reports are each
whole: gRPC retries a stream only before its first message anyway)."""

RETRIED_METHODS = (*IDEMPOTENT_METHODS, "Generate")
"""RPCs gRPC retries on UNAVAILABLE. Generate too: it is not idempotent (sampling), but gRPC
commits a call (no more retries) once the server sends it anything (headers or a chunk), so
only a Generate that got nothing is retried, and never replays chunks the caller saw: the one
a draining replica refused, or one that failed before its first token. A stream that fails
UNAVAILABLE after its first chunk raises MMServeError as before."""


def channel_target(target: str | Sequence[str]) -> str:
    """One gRPC target for one or several replicas. A string is used as it is ("host:port",
    or any gRPC name: "dns:///host:port", "ipv4:10.0.0.1:50051,10.0.0.2:50051", "unix:...").
    Several "host:port" strings become one ipv4: (or ipv6:) address list, host names resolved
    now: for replicas behind a name that changes, give that one "dns:///name:port" instead."""
    if isinstance(target, str):
        return target
    targets = list(target)
    if not targets:
        raise ValueError("target: give at least one host:port")
    if len(targets) == 1:
        return targets[0]
    resolved = [_resolve(t) for t in targets]
    families = {family for family, _ in resolved}
    if len(families) > 1:
        raise ValueError(
            f"target: {targets} mix IPv4 and IPv6 addresses; a gRPC address list holds one "
            "family (give one dns:/// name instead)"
        )
    scheme = "ipv4" if families == {socket.AF_INET} else "ipv6"
    return f"{scheme}:" + ",".join(address for _, address in resolved)


def _resolve(host_port: str) -> tuple[int, str]:
    """ "host:port" or "[v6]:port" -> (address family, "ip:port" / "[ip]:port")."""
    host, sep, port = host_port.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"target: {host_port!r} is not host:port (several targets are addresses)")
    host = host.removeprefix("[").removesuffix("]")
    family, _, _, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
    ip = str(sockaddr[0])
    return family, f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


def health_service(target: str | Sequence[str], health_check: bool | str | None) -> str | None:
    """The grpc.health.v1 service whose status picks replicas, None for no health checking:
    health_check None means on ("") for a list of several targets, off otherwise; True: "";
    a string: that service (a model's name); False: off."""
    if health_check is None:
        return "" if not isinstance(target, str) and len(list(target)) > 1 else None
    if isinstance(health_check, bool):
        return "" if health_check else None
    return health_check


def service_config(retry_attempts: int, health_service: str | None = None) -> str:
    """The channel's service config JSON: round-robin over the addresses the target resolves
    to (several replicas: a list of targets, or a DNS name with several addresses); with
    health_service, gRPC's client-side health checking leaves out a replica whose
    grpc.health.v1 status of that service is not SERVING ("": the server's, NOT_SERVING while
    it drains or any of its models is down; a model's name: that model's; a server without
    the health service counts as healthy); and up to `retry_attempts` attempts in all on
    UNAVAILABLE with exponential backoff (RETRIED_METHODS); 1 disables retries (gRPC caps
    attempts at 5)."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if health_service is not None:
        config["healthCheckConfig"] = {"serviceName": health_service}
    if retry_attempts > 1:
        config["methodConfig"] = [
            {
                "name": [{"service": SERVICE.full_name, "method": m} for m in RETRIED_METHODS],
                "retryPolicy": {
                    "maxAttempts": retry_attempts,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    return json.dumps(config)


def channel_options(
    max_message_bytes: int,
    retry_attempts: int,
    extra: Sequence[tuple[str, Any]],
    health_service: str | None = None,
) -> list[tuple[str, Any]]:
    """Options for grpc.(aio.)*_channel; `extra` comes last, so it overrides."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1 if retry_attempts > 1 else 0),
        ("grpc.service_config", service_config(retry_attempts, health_service)),
        *extra,
    ]


def open_channel(
    api: Any,
    target: str,
    tls: bool,
    credentials: grpc.ChannelCredentials | None,
    options: list[tuple[str, Any]],
) -> Any:
    """A channel from `api` (the grpc or the grpc.aio module: same factory names). Explicit
    credentials win; tls=True means the system's root certificates; else plaintext."""
    if credentials is None and tls:
        credentials = grpc.ssl_channel_credentials()
    if credentials is None:
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, credentials, options=options)


def call_metadata(
    api_key: str | None, extra: Sequence[tuple[str, str]]
) -> tuple[tuple[str, str], ...]:
    """Metadata sent on every call: `authorization: Bearer <api_key>` when a key is given."""
    auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return (*auth, *extra)


class ClientBase:
    """Channel, stub, metadata and default deadline shared by Client and AsyncClient; `_api`
    is the grpc module (sync) or grpc.aio. Constructor arguments: see Client."""

    _api: Any

    def __init__(
        self,
        target: str | Sequence[str],
        api_key: str | None = None,
        *,
        tls: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        retry_attempts: int = 4,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, Any]] = (),
        health_check: bool | str | None = None,
    ) -> None:
        opts = channel_options(
            max_message_bytes, retry_attempts, options, health_service(target, health_check)
        )
        self._channel: Any = open_channel(self._api, channel_target(target), tls, credentials, opts)
        stub_class: Any = inference_pb2_grpc.InferenceStub  # generated without type hints
        self._stub = stub_class(self._channel)
        self._metadata = call_metadata(api_key, metadata)
        self._timeout = timeout

    def _call_options(self, timeout: float | None) -> dict[str, Any]:
        """Per-call keyword arguments: the deadline (this call's, else the client's) and
        the metadata."""
        return {
            "timeout": self._timeout if timeout is None else timeout,
            "metadata": self._metadata,
        }

    def _start_watch_load(
        self, model: str, interval_ms: int, timeout: float | None, request_id: str = ""
    ) -> Any:
        """Starts a WatchLoad call; it runs until cancelled or `timeout` (the client's own
        timeout does not apply: the stream is meant to last)."""
        request = load_pb2.WatchLoadRequest(
            model=model, interval_ms=interval_ms, request_id=request_id
        )
        return self._stub.WatchLoad(request, timeout=timeout, metadata=self._metadata)

    def _start_generate(self, source: Any, n: int | None, kw: GenerateKwargs) -> Any:
        """Starts a Generate call (grpc's stream call object); `timeout` is taken out of kw."""
        timeout = kw.pop("timeout", None)
        request = generate_request(source, n, kw)
        return self._stub.Generate(request, **self._call_options(timeout))
