"""The one exception type the SDK raises for failed calls."""

from __future__ import annotations

import grpc


class MMServeError(Exception):
    """A call failed with a gRPC status other than OK.

    `code` is the status (see the error table in API.md: INVALID_ARGUMENT names the bad field,
    RESOURCE_EXHAUSTED means the server is at its admission limit, UNAVAILABLE that it is
    draining or unreachable, ...); `message` is the server's description. Mistakes caught
    before sending (an unknown keyword argument, a malformed message dict) are TypeError or
    ValueError instead.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> MMServeError:
        """Wraps the RpcError of a sync or asyncio call (both carry code() and details())."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")
