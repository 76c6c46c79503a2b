"""Raw-byte calls for the decode and fuzz tests: every method of mmserve.v1.Inference (from
its service descriptor, so a new RPC is covered) sent bytes the client does not serialize,
and protobuf wire-format pieces to build such bytes."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2

from mmserve_client.v1 import inference_pb2

INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
HEALTH_CHECK = health_pb2.DESCRIPTOR.services_by_name["Health"].methods_by_name["Check"]
ENDLESS = {"WatchLoad"}  # streams that last until the client leaves: their first answer decides
WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_GROUP_START, WIRE_GROUP_END, WIRE_I32 = range(6)


@dataclass(frozen=True)
class Outcome:
    """How a call ended: its status, details, and the responses before the status."""

    code: grpc.StatusCode
    details: str
    responses: int


def path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def call_raw(
    channel: grpc.Channel, method: MethodDescriptor, payload: bytes, timeout: float = 60
) -> Outcome:
    """Sends `payload` as the request of `method` (unary or server-streaming), reads every
    response (of an ENDLESS stream, the first, then cancels), and returns how the call ended."""
    try:
        if method.name in ENDLESS:
            call = channel.unary_stream(path(method))(payload, timeout=timeout)
            next(call)
            call.cancel()
            return Outcome(grpc.StatusCode.OK, "", 1)
        if method.server_streaming:
            call = channel.unary_stream(path(method))(payload, timeout=timeout)
            count = sum(1 for _ in call)
            return Outcome(call.code(), call.details() or "", count)
        channel.unary_unary(path(method))(payload, timeout=timeout)
        return Outcome(grpc.StatusCode.OK, "", 1)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", 0)


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative value (negative int64s: two's complement)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, data: bytes) -> bytes:
    return tag(number, WIRE_LEN) + varint(len(data)) + data


def first_string_field(message: Descriptor) -> FieldDescriptor:
    """The message's first top-level string field (every request has model or service)."""
    return next(f for f in message.fields if f.type == FieldDescriptor.TYPE_STRING)


def bad_utf8(message: Descriptor) -> bytes:
    """A message whose first string field holds bytes that are not UTF-8."""
    return length_delimited(first_string_field(message).number, b"ok\xc3\x28\xff")


def truncated(message: Descriptor) -> bytes:
    """A string field that claims 10 bytes and carries 3."""
    return tag(first_string_field(message).number, WIRE_LEN) + varint(10) + b"abc"
