"""A GGUF file's tensors and scalar metadata, read without parsing its big metadata arrays.

The `gguf` package's GGUFReader builds a numpy view for every element of every metadata array,
about 15 s for a Llama 3 vocabulary (128k tokens and 280k merges) on a 2-core CPU, before any
tensor is found; mmserve reads the tensors on every start of a GGUF model on CUDA (they stay in
their blocks there) and once per file on the CPU. This index walks the same layout (the GGUF
v2/v3 header, key/value metadata, tensor infos, aligned data) with struct: arrays of numbers
are skipped by their size, arrays of strings by their lengths alone, so the vocabulary costs
a fraction of a second. Scalars and strings are kept (general.architecture, general.alignment,
...); arrays are not. The tensors are memory-mapped numpy views shaped exactly as GGUFReader
shapes them (tests/models/test_gguf_index.py compares the two), so either can feed the loader.
Files in the other byte order are left to GGUFReader (`read_index` falls back to it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.GGUFValueType): scalar id -> struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# tensor types read as numbers rather than bytes (as GGUFReader reads them)
_NUMERIC = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
            "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class IndexedTensor:
    """What the loader reads of a GGUFReader tensor: name, type, data (memory-mapped)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


class GgufIndex:
    """fields: key -> scalar or string value (arrays are skipped); tensors in file order."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data.data)  # (zero-copy: struct reads the mapped bytes)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} (little-endian) is not supported")
        offs = 24
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key, offs = _string(buf, offs)
            (kind,) = struct.unpack_from("<I", buf, offs)
            value, offs = _value(buf, offs + 4, kind)
            if value is not _SKIPPED:
                self.fields[key] = value
        infos = []
        for _ in range(tensor_count):
            name, offs = _string(buf, offs)
            (n_dims,) = struct.unpack_from("<I", buf, offs)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, offs + 4)
            offs += 4 + 8 * n_dims
            raw_type, offset = struct.unpack_from("<IQ", buf, offs)
            offs += 12
            infos.append((name, dims, raw_type, offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}")
        start = -(-offs // alignment) * alignment
        self.tensors: list[IndexedTensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name}")
            seen.add(name)
            qtype = GGMLQuantizationType(raw_type)
            shape = tuple(reversed(dims))  # numpy order: the last GGUF dimension first
            n_elems = int(np.prod(dims, dtype=np.int64))
            begin = start + int(offset)
            numeric = _NUMERIC.get(qtype.name)
            if numeric is not None:
                data = self.data[begin : begin + n_elems * np.dtype(numeric).itemsize].view(numeric)
            else:
                block, size = GGML_QUANT_SIZES[qtype]
                if shape[-1] % block:
                    raise ValueError(f"tensor {name}: {shape[-1]} is not a multiple of {qtype.name}'s {block}")
                shape = (*shape[:-1], shape[-1] // block * size)  # the bytes of each row
                data = self.data[begin : begin + n_elems // block * size]
            self.tensors.append(IndexedTensor(name, qtype, data.reshape(shape)))


_SKIPPED = object()


def _string(buf: memoryview, offs: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offs)
    offs += 8
    return bytes(buf[offs : offs + length]).decode("utf-8"), offs + length


def _value(buf: memoryview, offs: int, kind: int) -> tuple[Any, int]:
    """(the value, or _SKIPPED for an array; the offset after it)."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, buf, offs)[0], offs + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(buf, offs)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item_kind, count = struct.unpack_from("<IQ", buf, offs)
    offs += 12
    if item_kind in _SCALARS:
        return _SKIPPED, offs + count * struct.calcsize(_SCALARS[item_kind])
    if item_kind == _STRING:
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            offs += 8 + unpack(buf, offs)[0]
        return _SKIPPED, offs
    for _ in range(count):  # arrays of arrays
        _, offs = _value(buf, offs, item_kind)
    return _SKIPPED, offs


def read_index(path: str | Path) -> Any:
    """GgufIndex for a little-endian GGUF v2/v3 file; GGUFReader for anything else (the other
    byte order), which raises its own errors for what is no GGUF at all."""
    try:
        return GgufIndex(path)
    except ValueError:
        from gguf import GGUFReader

        return GGUFReader(path)
