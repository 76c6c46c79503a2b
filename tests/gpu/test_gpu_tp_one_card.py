"""Tensor-parallel shards on CUDA with one card: the ranks are threads sharing the GPU, their
collectives a gloo group's on host copies (NCCL takes a GPU a rank; the device tool lends one).
What this checks is each rank's cut running on CUDA's kernels: weight-only checkpoints' packed
cuts (mmserve/kernels/wna16.py) and GGUF block cuts (gguf_gemm.py), against one rank on the
same card: in float32 (the kernels' exact products) to rounding, in bfloat16 by the picked tokens.
Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.attention.triton_backend import TritonAttentionBackend
from mmserve.config import ModelConfig
from mmserve.models.loader import load_model
from mmserve.models.parallel import TensorParallel
from tests.parallel.test_tp_models import chunked_logits, first_layer_projections, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class _Done:
    def wait(self) -> bool:
        return True


class HostGroup:
    """A gloo group's allreduce / allgather / broadcast for tensors on any device: through host
    copies, written back in place (gloo's allgather takes CPU tensors only)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def allreduce(self, xs: list[torch.Tensor], opts: Any = None) -> _Done:
        host = [x.cpu() for x in xs]
        (self.group.allreduce(host) if opts is None else self.group.allreduce(host, opts)).wait()
        for x, h in zip(xs, host, strict=True):
            x.copy_(h)
        return _Done()

    def allgather(self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor]) -> _Done:
        host_outs = [[o.cpu() for o in parts] for parts in outs]
        self.group.allgather(host_outs, [x.cpu() for x in ins]).wait()
        for parts, host in zip(outs, host_outs, strict=True):
            for o, h in zip(parts, host, strict=True):
                o.copy_(h)
        return _Done()

    def broadcast(self, x: torch.Tensor, root: int) -> _Done:
        host = x.cpu()
        self.group.broadcast(host, root).wait()
        x.copy_(host)
        return _Done()


def load_on(path: Path, device: str, dtype: str, tp: TensorParallel | None = None) -> Any:
    from mmserve.attention.torch_ref import TorchAttentionBackend

    backend = TritonAttentionBackend() if device.startswith("cuda") else TorchAttentionBackend()
    model, _, _ = load_model(ModelConfig(str(path)), device, dtype, backend, tp)
    return model


def compare_ranks(
    path: Path, size: int, device: str = "cuda", dtypes: tuple[str, ...] = ("float32", "bfloat16")
) -> list[Any]:
    """Logits at `size` ranks against one rank's: in float32 to rounding; in bfloat16 each
    row's picked token within 0.1 of one rank's best logit, and at least half of them its
    best (the tiny random models' next-token distributions are nearly flat). Returns the last
    dtype's ranks' models."""
    held: list[Any] = []
    for dtype in dtypes:
        with torch.no_grad():
            single = chunked_logits(load_on(path, device, dtype)).float()
        ranks = run_ranks(
            size, lambda tp, d=dtype: (chunked_logits(m := load_on(path, device, d, tp)), m), HostGroup, device, 300
        )
        for logits, _ in ranks:
            logits = logits.float()
            assert torch.isfinite(logits).all()
            if dtype == "float32":
                torch.testing.assert_close(logits, single, atol=2e-4, rtol=1e-4)
                continue
            picked = logits.argmax(-1, keepdim=True)
            short = single.max(-1).values - single.gather(-1, picked).squeeze(-1)
            assert short.max().item() <= 0.1, short
            assert (short == 0).float().mean().item() >= 0.5
        held = [m for _, m in ranks]
    return held


@pytest.mark.parametrize(
    "case",
    [("gptq", 4, 16, False, True), ("awq", 4, 16, False, False, "qwen2"), ("compressed-tensors", 8, 0, True, False)],
    ids=lambda c: "-".join(map(str, c)),
)  # fmt: skip
def test_weight_only_cuts_run_packed_on_cuda(tmp_path: Path, case: tuple) -> None:
    from mmserve.models.weight_only import WeightOnlyLinear
    from tests.models.test_weight_only import checkpoint

    path = Path(checkpoint(tmp_path, *case)[0])
    for model in compare_ranks(path, 2, dtypes=("bfloat16", "float32")):
        layers = first_layer_projections(model)
        packed = [isinstance(layer, WeightOnlyLinear) for layer in layers]
        assert packed == [True, not case[4], True, not case[4]]  # (act order: o, down float)


def test_gguf_cuts_keep_their_blocks_on_cuda(tmp_path: Path) -> None:
    """A Q4_K_M at 2 ranks (Q4_K and Q6_K blocks, the untied head's Q6_K rows cut)."""
    from mmserve.models.gguf_linear import GgufLinear
    from tests.utils.tiny_models import tiny_checkpoint

    path = tiny_checkpoint(tmp_path, "gguf:Q4_K_M", intermediate_size=1024)
    for model in compare_ranks(path, 2, dtypes=("bfloat16", "float32")):
        layers = first_layer_projections(model)
        assert all(isinstance(layer, GgufLinear) for layer in layers)
        assert [bool(layer.qtypes()) for layer in layers] == [True, False, True, True]  # (o: 128 columns)
        assert model.lm_head.qtypes() == {"Q6_K"}
