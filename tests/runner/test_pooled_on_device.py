"""PooledOnDevice.resolve: each request's result from the step's one flat host tensor, by id,
whether the results share one shape (one unbind) or not (split row by row)."""

from __future__ import annotations

import torch

from mmserve.runner.model_runner import PooledOnDevice


def test_results_of_one_shape_come_back_by_request_id() -> None:
    rows = torch.randn(5, 3)
    pooled = PooledOnDevice([f"r{i}" for i in range(5)], [(3,)] * 5, rows.reshape(-1), None)
    out = pooled.resolve()
    assert list(out) == [f"r{i}" for i in range(5)]
    for i in range(5):
        assert out[f"r{i}"].shape == (3,) and torch.equal(out[f"r{i}"], rows[i])


def test_results_of_several_shapes_come_back_by_request_id() -> None:
    parts = [torch.randn(3), torch.randn(1), torch.randn(2, 2), torch.randn(())]
    shapes = [tuple(p.shape) for p in parts]
    flat = torch.cat([p.reshape(-1) for p in parts])
    out = PooledOnDevice(["a", "b", "c", "d"], shapes, flat, None).resolve()
    for name, part in zip("abcd", parts, strict=True):
        assert out[name].shape == part.shape and torch.equal(out[name], part)
    scalars = PooledOnDevice(["x", "y"], [(), ()], torch.tensor([1.0, 2.0]), None).resolve()
    assert scalars["y"].shape == () and scalars["y"].item() == 2.0
