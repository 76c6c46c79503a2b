"""WeightOnlyLinear (a weight-only projection kept packed, run by mmserve/kernels/wna16.py) against
x @ W^T with W the dequantised weight: groups in order and in act order (permuted at load),
a GPTQ checkpoint's parts unpacked and repacked, 4 and 8 bits."""

import pytest
import torch

from mmserve.models.weight_only import (
    Unpacked,
    WeightOnlyCheckpoint,
    WeightOnlyLinear,
    _gptq_weight,
)
from tests.kernels.conftest import DEVICE


def _unpacked(n: int, k: int, bits: int, group_size: int, act_order: bool) -> Unpacked:
    g = torch.Generator().manual_seed(n + k)
    groups = torch.arange(k) // group_size
    if act_order:
        groups = groups[torch.randperm(k, generator=g)]
    count = int(groups.max()) + 1
    return Unpacked(
        torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32),
        torch.randint(0, 1 << bits, (n, count), generator=g, dtype=torch.int32),
        (torch.rand(n, count, generator=g) * 0.02 + 0.001).half(),
        groups,
    )


@pytest.mark.parametrize("bits,group_size,act_order", [(4, 32, False), (4, 16, True), (8, 64, True)])
def test_packed_projection_is_the_dequantised_one(bits: int, group_size: int, act_order: bool) -> None:
    u = _unpacked(72, 128, bits, group_size, act_order)
    bias = torch.randn(72)
    layer = WeightOnlyLinear.from_unpacked(u, bits, torch.float32, bias).to(DEVICE)
    assert (layer.perm is not None) == act_order
    x = torch.randn(5, 128)
    out = layer(x.to(DEVICE)).cpu()
    expected = x @ u.dequantize().t() + bias
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_a_symmetric_projection_keeps_no_zeros(bits: int) -> None:
    """Zero points all 2^(bits - 1) (a symmetric checkpoint): none kept, none read."""
    u = _unpacked(40, 64, bits, 32, act_order=False)
    u.zeros = torch.full_like(u.zeros, 1 << (bits - 1))
    layer = WeightOnlyLinear.from_unpacked(u, bits, torch.float32).to(DEVICE)
    assert layer.zeros is None
    x = torch.randn(4, 64)
    expected = x @ u.dequantize().t()
    torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_a_gptq_checkpoints_parts_repack() -> None:
    """GPTQ's qweight / qzeros / scales / g_idx (v1), unpacked then repacked: same product."""
    from tests.models.test_weight_only import pack_rows

    u = _unpacked(64, 96, 4, 32, act_order=True)
    u.zeros = u.zeros.clamp(min=1)  # (v1 stores zero - 1: a zero of 0 cannot be written)
    parts = {
        "qweight": pack_rows(u.q, 4).t().contiguous(),
        "qzeros": pack_rows((u.zeros - 1).t().contiguous(), 4),
        "scales": u.scales.t().contiguous(),
        "g_idx": u.groups.int(),
    }
    read = _gptq_weight("p", parts, WeightOnlyCheckpoint("gptq", 4, 32, False, gptq_v1=True))
    layer = WeightOnlyLinear.from_unpacked(read, 4, torch.float32).to(DEVICE)
    x = torch.randn(3, 96)
    expected = x @ u.dequantize().t()
    torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_groups_that_are_not_runs_of_one_size_are_refused() -> None:
    u = _unpacked(8, 64, 4, 32, act_order=False)
    u.groups = torch.cat([torch.zeros(24), torch.ones(40)]).long()  # (a longer last group)
    with pytest.raises(ValueError, match="not runs of one size"):
        WeightOnlyLinear.from_unpacked(u, 4, torch.float32)


@pytest.mark.parametrize(
    "case", [("gptq", 4, 16, False, True, "llama"), ("awq", 4, 32, False, False, "qwen2")], ids=str
)
def test_a_checkpoint_stays_packed_where_the_kernel_runs(tmp_path, monkeypatch, case) -> None:  # type: ignore[no-untyped-def]
    """Where the kernel runs (CUDA; here the Triton interpreter) every decoder projection is
    a WeightOnlyLinear holding the packed weight (q/k/v and gate/up merged), and the greedy
    tokens are transformers' on the dequantised weights."""
    from mmserve import LLM, SamplingParams
    from mmserve.models import weight_only
    from tests.models.test_weight_only import PROMPT, checkpoint

    monkeypatch.setattr(weight_only, "PACKED_ON", ("cuda", "cpu"))
    path, hf = checkpoint(tmp_path, *case)
    llm = LLM(path, kv_cache_memory=8 << 20, device=DEVICE.type, dtype="float32", num_kv_blocks=64)
    model = llm.frontend.core.runner.model
    packed = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    assert len(packed) == 4 * hf.config.num_hidden_layers  # qkv, o, gate_up, down
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False, pad_token_id=0)[0, len(ids):].tolist()  # fmt: skip
    assert got == want
