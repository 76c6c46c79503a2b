"""API keys: `authorization: Bearer <key>` metadata checked on every RPC but health."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

# Load balancers and orchestrators probe health without credentials. Reflection is covered:
# grpcurl sends its -H headers with reflection requests too.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def load_api_keys(path: str | Path) -> list[str]:
    """One key per line; blank lines and lines starting with # are skipped."""
    lines = Path(path).read_text().splitlines()
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"api key file {path}: no keys in it")
    return keys


def _digest(key: str | bytes) -> bytes:
    # Comparing fixed-length digests keeps the comparison's time independent of key lengths.
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc has no stubs
    """Refuses calls without a valid key with UNAUTHENTICATED, before any handler runs."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._digests = [_digest(k) for k in keys]

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None:
            return False
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, key = text.partition(" ")
        if scheme.lower() != "bearer":
            return False
        presented = _digest(key.strip())
        # Check every key, without stopping at a match: timing reveals nothing about which.
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(presented, digest)
        return ok

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(EXEMPT_PREFIXES) or self.authorized(
            details.invocation_metadata
        ):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return handler
        return refusing_handler(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or invalid API key: send metadata `authorization: Bearer <key>`",
        )


def refusing_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends every call with `code`."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
