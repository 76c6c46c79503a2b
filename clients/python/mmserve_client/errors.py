"""The one exception type the SDK raises for failed calls."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"
"""Trailing metadata holding a google.rpc.Status with the error's details (gRPC's rich errors)."""


class MMServeError(Exception):
    """A call failed with a gRPC status other than OK.

    `code` is the status (see the error table in API.md: INVALID_ARGUMENT names the bad field,
    RESOURCE_EXHAUSTED means the server is at its admission limit, UNAVAILABLE that it is
    draining or unreachable, ...); `message` is the server's description. From the status's
    google.rpc details: `field`, the bad field's path for INVALID_ARGUMENT (e.g.
    "params.temperature", "chat.messages[0].role"; None when the server named none), and
    `retry_delay`, the seconds the server asks a client to wait before trying again (with
    RESOURCE_EXHAUSTED; None when it suggested none). Mistakes caught before sending (an
    unknown keyword argument, a malformed message dict) are TypeError or ValueError instead.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        field: str | None = None,
        retry_delay: float | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.retry_delay = retry_delay

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> MMServeError:
        """Wraps the RpcError of a sync or asyncio call (both carry code() and details(), and
        trailing_metadata() with the rich details)."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        field, retry_delay = _rich_details(trailers or ())
        return cls(
            code or grpc.StatusCode.UNKNOWN, details or "", field=field, retry_delay=retry_delay
        )


def _rich_details(trailers: Iterable[tuple[str, Any]]) -> tuple[str | None, float | None]:
    """(field, retry delay in seconds) from a google.rpc.Status in the trailing metadata; a
    detail that is missing or does not decode gives None."""
    raw = next((v for k, v in trailers if k == STATUS_DETAILS_KEY), None)
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw or b"")
    except DecodeError:  # a broken detail must not hide the error itself
        return None, None
    field, retry_delay = None, None
    bad, retry = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
    for detail in status.details:
        if detail.Is(bad.DESCRIPTOR) and detail.Unpack(bad) and bad.field_violations:
            field = field or bad.field_violations[0].field
        elif detail.Is(retry.DESCRIPTOR) and detail.Unpack(retry):
            retry_delay = retry.retry_delay.ToNanoseconds() / 1e9
    return field, retry_delay
