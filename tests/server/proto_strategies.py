"""Hypothesis strategies for protobuf messages, built from their descriptors so that a new
field or RPC is fuzzed without touching the tests: boundary integers, NaN and infinities,
empty / long / unicode strings, open enums' unknown values, huge repeated fields, random
oneof members, nested messages, and raw unknown fields (deeply nested groups among them)
appended to the wire bytes.

`overrides` maps a field's full name (or bare name, e.g. "model") to the strategy of its
value (of one element for repeated fields; a map's key and value are the fields of its entry
message, e.g. "mmserve.v1.SamplingParams.LogitBiasEntry.key")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from tests.server.raw_rpc import (
    WIRE_GROUP_END,
    WIRE_GROUP_START,
    WIRE_I32,
    WIRE_I64,
    WIRE_LEN,
    WIRE_VARINT,
    length_delimited,
    tag,
    varint,
)

Overrides = Mapping[str, st.SearchStrategy[Any]]
F = FieldDescriptor
MAX_DEPTH = 8  # nested messages below this are left empty (these protos nest 4 deep)
SMALL_REPEATED = 4
HUGE_REPEATED = (65, 300, 1100)  # past prompt, context and image limits: one value repeated
# 6000+ characters: past every prompt limit of the test server (built, to keep reprs short)
LONG_TEXT = st.integers(600, 700).map(lambda n: "long text " * n)
MAX_FIELD_NUMBER = 2**29 - 1
MAX_GROUP_DEPTH = 150  # past the parser's nesting limit (100)
# How often a field is set: lists and messages usually (requests need their inputs), scalars
# half the time (each can be the one bad value that ends the request before the handler).
SET_COMPOUND = st.sampled_from([True, True, True, False])
SET_SCALAR = st.booleans()

_INT32 = (-(2**31), 2**31 - 1)
_UINT32 = (0, 2**32 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_UINT64 = (0, 2**64 - 1)
_INT_RANGES = {
    F.TYPE_INT32: _INT32, F.TYPE_SINT32: _INT32, F.TYPE_SFIXED32: _INT32,
    F.TYPE_UINT32: _UINT32, F.TYPE_FIXED32: _UINT32,
    F.TYPE_INT64: _INT64, F.TYPE_SINT64: _INT64, F.TYPE_SFIXED64: _INT64,
    F.TYPE_UINT64: _UINT64, F.TYPE_FIXED64: _UINT64,
}  # fmt: skip
INT_EDGES = (0, 1, -1, 2, 2**31 - 1, -(2**31), 2**31, 2**32 - 1, 2**63 - 1, -(2**63), 2**64 - 1)
FLOAT_EDGES = (math.nan, math.inf, -math.inf, -0.0, 3.4e38, 1e-45, -1.0, 1.0, 0.5)


def mostly(
    plausible: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    """Plausible values three times in four, so that requests often get past validation into
    the handlers; hostile ones (edges, garbage) the rest of the time. (st.one_of would pick
    about evenly between two; shrinking goes to the first choice: the plausible.)"""
    return st.sampled_from([plausible, plausible, plausible, hostile]).flatmap(lambda s: s)


TEXT = mostly(
    st.one_of(
        st.sampled_from(["Hello", "a cat sits on the mat", "é🙂中文", "<|im_start|>user", "{"]),
        st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=24),  # UTF-8
    ),
    st.one_of(st.sampled_from(["", "\x00\x01", "\u202e", " "]), LONG_TEXT),
)
BYTES = st.one_of(st.binary(max_size=48), st.just(b"\x89PNG\r\n\x1a\n" + b"\x00" * 16))


def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Small values mostly; boundary values and any integer of the range the rest."""
    edges = [e for e in INT_EDGES if lo <= e <= hi]
    hostile = st.one_of(st.sampled_from(edges), st.integers(lo, hi))
    return mostly(st.integers(max(lo, 0), min(hi, 8)), hostile)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INT_RANGES:
        return integers(*_INT_RANGES[field.type])
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        width = 32 if field.type == F.TYPE_FLOAT else 64
        hostile = st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(width=width))
        return mostly(st.floats(0.0, 2.0, width=width), hostile)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_STRING:
        return TEXT
    if field.type == F.TYPE_BYTES:
        return BYTES
    if field.type == F.TYPE_ENUM:  # proto3 enums are open: unknown numbers parse too
        known = [v.number for v in field.enum_type.values]
        return mostly(st.sampled_from(known), integers(*_INT32))
    raise TypeError(f"{field.full_name}: no strategy for type {field.type}")


def _element(field: FieldDescriptor, overrides: Overrides, depth: int) -> st.SearchStrategy[Any]:
    """One value of the field (one element, if repeated)."""
    custom = overrides.get(field.full_name, overrides.get(field.name))
    if custom is not None:
        return custom
    if field.type == F.TYPE_MESSAGE:
        return messages(field.message_type, overrides, depth + 1)
    return _scalar(field)


def _value(field: FieldDescriptor, overrides: Overrides, depth: int) -> st.SearchStrategy[Any]:
    if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        entry = field.message_type.fields_by_name
        key, value = (_element(entry[n], overrides, depth) for n in ("key", "value"))
        return st.dictionaries(key, value, max_size=SMALL_REPEATED)
    one = _element(field, overrides, depth)
    if not field.is_repeated:
        return one
    huge = st.tuples(one, st.sampled_from(HUGE_REPEATED)).map(lambda vn: [vn[0]] * vn[1])
    small = st.lists(one, min_size=1, max_size=SMALL_REPEATED)
    return mostly(small, st.one_of(st.just([]), huge))


def _set(message: Message, field: FieldDescriptor, value: Any) -> None:
    if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        getattr(message, field.name).update(value)
    elif field.is_repeated:
        getattr(message, field.name).extend(value)
    elif field.type == F.TYPE_MESSAGE:
        getattr(message, field.name).SetInParent()  # set, even when empty
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def _real_oneof(field: FieldDescriptor) -> bool:
    """In a oneof that is not the synthetic one of a proto3 `optional` field."""
    oneof = field.containing_oneof
    return oneof is not None and not (len(oneof.fields) == 1 and oneof.name == f"_{field.name}")


@st.composite
def messages(
    draw: st.DrawFn,
    descriptor: Descriptor,
    overrides: Overrides,
    depth: int = 0,
    required: frozenset[str] = frozenset(),
) -> Message:
    """A message of `descriptor`'s type: any subset of its fields (those of this message, not
    of nested ones, named in `required` always), at most one member of each oneof (or none),
    nested messages filled the same way down to MAX_DEPTH."""
    message = GetMessageClass(descriptor)()
    if depth > MAX_DEPTH:
        return message
    # a member of each oneof, mostly: requests need their input (None last: shrinks to a member)
    picked = {draw(st.sampled_from([*o.fields, *o.fields, None])) for o in descriptor.oneofs}
    for field in descriptor.fields:
        compound = field.is_repeated or field.type == F.TYPE_MESSAGE
        if _real_oneof(field):
            chosen = field in picked
        else:
            chosen = field.name in required or draw(SET_COMPOUND if compound else SET_SCALAR)
        if chosen:
            _set(message, field, draw(_value(field, overrides, depth)))
    return message


def unknown_fields(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Raw fields of numbers the message does not declare, in every wire type; groups nest
    up to MAX_GROUP_DEPTH deep (past the parser's limit, which must answer INVALID_ARGUMENT)."""
    known = {f.number for f in descriptor.fields}
    number = st.integers(1, MAX_FIELD_NUMBER).filter(lambda n: n not in known)

    def one(n: int, kind: int, data: bytes, depth: int, big: int) -> bytes:
        if kind == WIRE_VARINT:
            return tag(n, WIRE_VARINT) + varint(big)
        if kind == WIRE_I64:
            return tag(n, WIRE_I64) + data.ljust(8, b"\0")[:8]
        if kind == WIRE_I32:
            return tag(n, WIRE_I32) + data.ljust(4, b"\0")[:4]
        if kind == WIRE_GROUP_START:
            return tag(n, WIRE_GROUP_START) * depth + tag(n, WIRE_GROUP_END) * depth
        return length_delimited(n, data)

    field = st.builds(
        one,
        number,
        st.sampled_from([WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_GROUP_START, WIRE_I32]),
        st.binary(max_size=16),
        mostly(st.integers(1, 8), st.integers(1, MAX_GROUP_DEPTH)),
        integers(*_UINT64),
    )
    return st.lists(field, min_size=1, max_size=3).map(b"".join)
