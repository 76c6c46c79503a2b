"""The wNa16 checkpoint `mmserve bench quality` re-quantises from float weights: a
compressed-tensors pack-quantized folder whose projections are round-to-nearest int weights
(read back by mmserve's own unpacker), the other tensors and the tokenizer as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve.bench.requantize import PROJECTIONS, write_weight_only
from mmserve.models.source import ModelSource, iter_weights, load_hf_config
from mmserve.models.weight_only import checkpoint_weight_only, dequantize_weight_only
from tests.utils.tiny_models import make_tiny_model

pytest.importorskip("compressed_tensors")


def test_the_requantized_checkpoint_is_round_to_nearest(tmp_path: Path) -> None:
    """Read back by mmserve's unpacker: each projection = clamp(round(w / s)) * s with s =
    absmax / 7.5 per group of 32 (compressed-tensors' symmetric int4 range); the rest as it was."""
    model = make_tiny_model(tmp_path)
    folder = write_weight_only(str(model), tmp_path / "w4", 4, 32)
    source = ModelSource(folder, None)
    checkpoint = checkpoint_weight_only(load_hf_config(source))
    assert checkpoint is not None and checkpoint.scheme == "w4a16-g32"
    assert (folder / "tokenizer.json").is_file()
    original = dict(iter_weights(ModelSource(model, None), None))
    got = dict(dequantize_weight_only(iter_weights(source, None), checkpoint))
    assert got.keys() == original.keys()
    for name, w in original.items():
        if name.split(".")[-2] in PROJECTIONS:
            groups = w.unflatten(-1, (-1, 32))
            scale = groups.abs().amax(-1, keepdim=True) / 7.5
            want = ((groups / scale).round().clamp(-8, 7) * scale).flatten(-2)
            torch.testing.assert_close(got[name], want, atol=1e-6, rtol=0)
        else:
            assert torch.equal(got[name], w), name


def test_a_group_size_that_does_not_divide_is_refused(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path)  # FFN 128 (down_proj's input): groups of 48 do not divide it
    with pytest.raises(ValueError, match="down_proj: 128 input channels are not a multiple of the group size 48"):
        write_weight_only(str(model), tmp_path / "w4", 4, 48)
