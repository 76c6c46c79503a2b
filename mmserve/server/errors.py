"""Exceptions -> gRPC status codes (API.md's error table), with google.rpc rich details."""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from mmserve.errors import (
    EngineDead,
    EngineStalled,
    InvalidArgument,
    MMServeError,
    RankLost,
    ResourceExhausted,
)

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
# Of a status message, UTF-8. Messages quote the client's values; sent twice (grpc-message,
# percent-encoded, and in grpc-status-details-bin) a long one passed the clients' 8 KiB
# metadata limit, and the call reached them as RESOURCE_EXHAUSTED "Stream removed" instead.
MAX_STATUS_MESSAGE_BYTES = 1024


class Unimplemented(MMServeError):
    """A feature the server does not serve yet (UNIMPLEMENTED); the message names the field."""


class EngineFailed(MMServeError):
    """The engine failed this request, or is dead (INTERNAL)."""


class EngineUnavailable(MMServeError):
    """The model's engine died or stalled: it serves nothing until restarted (UNAVAILABLE,
    which clients may retry elsewhere)."""


class Draining(MMServeError):
    """The server is shutting down and takes no new calls (UNAVAILABLE)."""


def engine_error(handle_name: str, dead: BaseException) -> MMServeError:
    """What a call whose engine died under it gets: INTERNAL when the engine failed (crashed,
    its process killed), UNAVAILABLE when the watchdog declared it stalled or a rank of a
    tensor-parallel model was lost (API.md)."""
    if isinstance(dead, (EngineStalled, RankLost)):
        return EngineUnavailable(f"model {handle_name!r} is not serving: {dead}")
    return EngineFailed(f"model {handle_name!r}: engine failed: {dead}")


class ResponseTooLarge(MMServeError):
    """The answer would exceed the server's message limit (RESOURCE_EXHAUSTED, as gRPC's own
    size check says, but without RetryInfo: the same request would fail again)."""


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ResponseTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (EngineUnavailable, grpc.StatusCode.UNAVAILABLE),
    (EngineDead, grpc.StatusCode.UNAVAILABLE),  # met outside a request's stream (restarting)
    (EngineFailed, grpc.StatusCode.INTERNAL),
]


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status code of an exception; anything unexpected is INTERNAL."""
    return next((code for kind, code in _CODES if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)


# An absolute path in a message: a slash-led run of path characters, not inside a word (so
# "application/json" is left alone). JSON pointers look the same; they do not exist on disk.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/[\w.~+@%=-]+(?:/[\w.~+@%=-]*)*")
_SERVER_DIRS = tuple(
    {
        str(Path(d).resolve())
        for d in (os.getcwd(), str(Path.home()), sys.prefix, sys.base_prefix, tempfile.gettempdir())
    }
    - {"/"}
)


def redact_paths(message: str) -> str:
    """The message with every server-side path (one under the server's working, home, temp or
    Python directories, or any that exists here) replaced by "<path>": a client never learns
    the server's layout, whatever an exception happened to say."""

    def hide(match: re.Match[str]) -> str:
        path = match.group(0)
        under = any(path == d or path.startswith(d + "/") for d in _SERVER_DIRS)
        exists = path.count("/") > 1 and os.path.lexists(path)
        return "<path>" if under or exists else path

    return _ABSOLUTE_PATH.sub(hide, message)


def rich_status(
    code: grpc.StatusCode,
    message: str,
    retry_after_s: float | None,
    violation: tuple[str, str] | None = None,
) -> grpc.Status:
    """A status whose trailing metadata carries google.rpc.Status (grpc-status-details-bin),
    with RetryInfo when the client should come back later, and a BadRequest naming the field
    (`violation`: its path, as "params.temperature", and what is wrong with it) so that a
    client reads the field without parsing the message."""
    details: list[Message] = []
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(retry_after_s * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    if violation is not None:
        field, description = violation
        bad = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
        details.append(error_details_pb2.BadRequest(field_violations=[bad]))
    packed = [_packed(d) for d in details]
    status = status_pb2.Status(code=code.value[0], message=message, details=packed)
    return rpc_status.to_status(status)


def _packed(detail: Message) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(detail)
    return out


def within_limit(response: M, limit: int) -> M:
    """The response, if its serialized size fits the message limit. Left to gRPC, a larger
    one fails in the core after the handler returned, logged as an ERROR with a traceback."""
    size = response.ByteSize()
    if size > limit:
        raise ResponseTooLarge(
            f"response: {size} bytes, over the server's message limit of {limit} bytes "
            "(max_message_bytes); ask for less in one call"
        )
    return response


def bounded(message: str, limit: int = MAX_STATUS_MESSAGE_BYTES) -> str:
    """The message, cut to `limit` bytes of UTF-8 (its start names the field)."""
    data = message.encode()
    if len(data) <= limit:
        return message
    cut = data[:limit].decode(errors="ignore")
    return f"{cut}... ({len(data)} bytes in all)"


def _violation(exc: BaseException) -> tuple[str, str] | None:
    """(field, description) of a bad field, cut and redacted as messages are; the two share
    the status message's byte budget, so the status still fits the clients' metadata limit."""
    if not isinstance(exc, InvalidArgument):
        return None
    half = MAX_STATUS_MESSAGE_BYTES // 2
    return redact_paths(bounded(exc.field, half)), redact_paths(bounded(exc.message, half))


async def abort(
    context: grpc.aio.ServicerContext, exc: BaseException, retry_after_s: float
) -> NoReturn:
    """Ends the call with the status of exc (an InvalidArgument's field also travels as a
    google.rpc.BadRequest). Unexpected exceptions are logged with their traceback and reach
    the client without internals."""
    code = code_of(exc)
    if isinstance(exc, MMServeError):
        message = redact_paths(bounded(str(exc)))  # bounded first: the redaction reads the disk
    else:
        logger.exception("unexpected error in a call", exc_info=exc)
        message = f"internal error ({type(exc).__name__}); see the server log"
    retry = retry_after_s if isinstance(exc, ResourceExhausted) else None
    status = rich_status(code, bounded(message), retry, _violation(exc))
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers
