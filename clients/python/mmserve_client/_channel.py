"""Channel settings shared by Client and AsyncClient: retries, message limits, auth metadata."""

from __future__ import annotations

import json
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
"""RPCs that gRPC may retry on UNAVAILABLE. Not Generate: it is not idempotent (sampling), and
a retried stream could replay chunks the caller has already consumed (WatchLoad's reports are
each whole: gRPC retries a stream only before its first message anyway)."""


def service_config(retry_attempts: int) -> str:
    """The channel's service config JSON: round-robin over the addresses the target resolves to
    (several replicas behind one DNS name), and for the idempotent RPCs up to `retry_attempts`
    attempts in all on UNAVAILABLE with exponential backoff; 1 disables retries (gRPC caps
    attempts at 5)."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if retry_attempts > 1:
        config["methodConfig"] = [
            {
                "name": [{"service": SERVICE.full_name, "method": m} for m in IDEMPOTENT_METHODS],
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
    max_message_bytes: int, retry_attempts: int, extra: Sequence[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    """Options for grpc.(aio.)*_channel; `extra` comes last, so it overrides."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1 if retry_attempts > 1 else 0),
        ("grpc.service_config", service_config(retry_attempts)),
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
        target: str,
        api_key: str | None = None,
        *,
        tls: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        retry_attempts: int = 4,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        opts = channel_options(max_message_bytes, retry_attempts, options)
        self._channel: Any = open_channel(self._api, target, tls, credentials, opts)
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

    def _start_watch_load(self, model: str, interval_ms: int, timeout: float | None) -> Any:
        """Starts a WatchLoad call; it runs until cancelled or `timeout` (the client's own
        timeout does not apply: the stream is meant to last)."""
        request = load_pb2.WatchLoadRequest(model=model, interval_ms=interval_ms)
        return self._stub.WatchLoad(request, timeout=timeout, metadata=self._metadata)

    def _start_generate(self, source: Any, n: int | None, kw: GenerateKwargs) -> Any:
        """Starts a Generate call (grpc's stream call object); `timeout` is taken out of kw."""
        timeout = kw.pop("timeout", None)
        request = generate_request(source, n, kw)
        return self._stub.Generate(request, **self._call_options(timeout))
