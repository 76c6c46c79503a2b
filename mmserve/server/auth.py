"""API keys: `authorization: Bearer <key>` metadata checked on every RPC but health, and the
tenant each key belongs to (its prefix-cache and image-uuid scope)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

# Load balancers and orchestrators probe health without credentials. Reflection is covered:
# grpcurl sends its -H headers with reflection requests too.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Key -> tenant. One key per line, optionally followed by a tenant name (keys of one
    tenant share its caches); blank lines and lines starting with # are skipped."""
    keys: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].startswith("#"):
            keys[fields[0]] = fields[1] if len(fields) > 1 else key_tenant(fields[0])
    if not keys:
        raise ValueError("the api key file has no keys in it")
    return keys


def key_tenant(key: str) -> str:
    """The tenant of a key without a name: a digest, which says nothing about the key."""
    return "key:" + hashlib.sha256(b"mmserve-tenant\0" + key.encode()).hexdigest()[:16]


def _digest(key: str | bytes) -> bytes:
    # Comparing fixed-length digests keeps the comparison's time independent of key lengths.
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc has no stubs
    """Refuses calls without a valid key with UNAUTHENTICATED, before any handler runs."""

    def __init__(self, keys: Sequence[str] | Mapping[str, str]) -> None:
        """keys: the valid keys, or key -> tenant (load_api_keys)."""
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        tenants = keys if isinstance(keys, Mapping) else {k: key_tenant(k) for k in keys}
        self._digests = [(_digest(k), t) for k, t in tenants.items()]

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        return self.tenant(metadata) is not None

    def tenant(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """The tenant of the call's key; None without a valid one."""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None:
            return None
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, key = text.partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = _digest(key.strip())
        # Check every key, without stopping at a match: timing reveals nothing about which.
        found = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

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


def _unread(raw: bytes) -> None:
    """A refused call's request is never parsed: a caller without a key learns nothing about
    the API from how its bytes decode, and cannot make the server spend time parsing them."""


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
        request_deserializer=_unread,
        response_serializer=handler.response_serializer,
    )
