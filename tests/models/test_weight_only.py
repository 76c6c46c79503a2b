"""Weight-only int4/int8 checkpoints: compressed-tensors pack-quantized (packed with the
compressed-tensors library's own packer), GPTQ and AWQ (packed by reference packers written
from the formats' documentation, their unpacking checked against the library's where it has
one). Each loads dequantised, and its logits and 16 greedy tokens are those of transformers
running the same dequantised weights; ListModels names the scheme; what cannot be read
exactly is refused, naming the config field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.errors import UnsupportedModel
from mmserve.models.weight_only import unpack_int32
from tests.utils.tiny_models import make_tiny_hf_model, make_tiny_tokenizer

pack_to_int32 = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers").pack_to_int32
PROMPT = "Paged attention stores keys and values in fixed-size blocks."
# AutoAWQ's WQLinear_GEMM packing order, written out here (not taken from the code under test)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: torch.Tensor, bits: int, groups: torch.Tensor, symmetric: bool):  # type: ignore[no-untyped-def]
    """A reference quantiser: signed q [out, in], zero points [out, G] (signed, as
    compressed-tensors keeps them), float16 scales [out, G]; groups [in] is each input
    channel's group. Returns them and the dequantised weight (q - z) * s."""
    count = int(groups.max()) + 1
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    scales = torch.empty(w.shape[0], count)
    zeros = torch.zeros(w.shape[0], count, dtype=torch.int32)
    for g in range(count):
        cols = w[:, groups == g]
        if symmetric:
            scales[:, g] = cols.abs().amax(1).clamp_min(1e-8) / high
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = ((hi - lo) / (high - low)).clamp_min(1e-8)
            zeros[:, g] = (low - torch.round(lo / scales[:, g])).clamp(low + 1, high).int()
    scales = scales.half()
    s, z = scales.float()[:, groups], zeros[:, groups]
    q = (torch.round(w / s) + z).clamp(low, high).int()
    return q, zeros, scales, (q - z).float() * s


def group_index(in_features: int, group_size: int, act_order: bool) -> torch.Tensor:
    size = group_size or in_features
    if not act_order:
        return torch.arange(in_features) // size
    return torch.randperm(in_features, generator=torch.Generator().manual_seed(5)) // size


def pack_rows(values: torch.Tensor, bits: int, order: tuple[int, ...] = ()) -> torch.Tensor:
    """Reference packer: unsigned [rows, n] -> int32 [rows, n / per]; value j at bits
    (j % per) * bits of word j // per, or with an order value per * word + order[k] at k."""
    per = 32 // bits
    rows, n = values.shape
    words = torch.zeros(rows, n // per, dtype=torch.int64)
    for k in range(per):
        column = order[k] if order else k
        words |= values[:, column::per].long() << (k * bits)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # (as two's complement)


def write(folder: Path, hf, tensors: dict[str, torch.Tensor], qc: dict) -> str:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    hf.config.quantization_config = qc
    hf.config.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def checkpoint(  # type: ignore[no-untyped-def]
    folder: Path, fmt: str, bits: int, group_size: int, symmetric: bool, act_order: bool,
    arch: str = "llama",
):  # fmt: skip
    """A tiny model's checkpoint in a format, and transformers' model on the dequantised
    weights (the same model otherwise; a Qwen2's q/k/v biases stay float)."""
    hf = make_tiny_hf_model(arch, seed=2)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or prefix.rsplit(".", 1)[-1] not in PROJECTIONS:
            tensors[name] = w.contiguous()
            continue
        groups = group_index(w.shape[1], group_size, act_order)
        q, z, s, dequantised = quantize(w.float(), bits, groups, symmetric)
        state[name] = dequantised
        offset = 1 << (bits - 1)
        if fmt == "compressed-tensors":
            tensors[f"{prefix}.weight_packed"] = pack_to_int32(q.to(torch.int8), bits)
            tensors[f"{prefix}.weight_scale"] = s
            tensors[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape))
            if not symmetric:
                tensors[f"{prefix}.weight_zero_point"] = pack_to_int32(z.to(torch.int8), bits, packed_dim=0)
            if act_order:
                tensors[f"{prefix}.weight_g_idx"] = groups.int()
        elif fmt == "gptq":  # v1: unsigned values, zeros stored minus one
            tensors[f"{prefix}.qweight"] = pack_rows(q + offset, bits).t().contiguous()  # [in / per, out]
            tensors[f"{prefix}.qzeros"] = pack_rows((z + offset - 1).t().contiguous(), bits)
            tensors[f"{prefix}.scales"] = s.t().contiguous()
            tensors[f"{prefix}.g_idx"] = groups.int()
        else:  # awq: [in, out] packed along out in AWQ_ORDER
            tensors[f"{prefix}.qweight"] = pack_rows((q + offset).t().contiguous(), bits, AWQ_ORDER)
            tensors[f"{prefix}.qzeros"] = pack_rows((z + offset).t().contiguous(), bits, AWQ_ORDER)
            tensors[f"{prefix}.scales"] = s.t().contiguous()
    if fmt == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
                   "strategy": "group" if group_size else "channel", "group_size": group_size or None,
                   "actorder": "group" if act_order else None}  # fmt: skip
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}  # fmt: skip
    elif fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size or -1,
              "desc_act": act_order, "sym": symmetric, "checkpoint_format": "gptq"}  # fmt: skip
    else:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": not symmetric,
              "version": "gemm"}  # fmt: skip
    path = write(folder, hf, tensors, qc)
    hf.load_state_dict(state)
    hf.config.quantization_config = None
    return path, hf.float().eval()


CASES = [
    ("compressed-tensors", 4, 32, True, False, "qwen2"),
    ("gptq", 4, 32, False, False, "qwen2"),
    ("awq", 4, 16, False, False, "qwen2"),
    ("compressed-tensors", 4, 32, True, False),
    ("compressed-tensors", 4, 16, False, True),  # asymmetric, act order
    ("compressed-tensors", 8, 0, True, False),  # w8a16 per channel
    ("gptq", 4, 32, True, False),
    ("gptq", 4, 16, False, True),  # act order (g_idx), asymmetric
    ("gptq", 8, 0, True, False),
    ("awq", 4, 32, False, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_logits_and_greedy_are_transformers_on_the_dequantised_weights(
    tmp_path: Path, case: tuple
) -> None:
    bits, group_size = case[1:3]
    path, hf = checkpoint(tmp_path, *case)
    llm = LLM(path, kv_cache_memory=8 << 20)
    scheme = f"w{bits}a16" + (f"-g{group_size}" if group_size else "")
    assert llm.frontend.info.quantization == scheme
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, pad_token_id=0)[0, len(ids):].tolist()  # fmt: skip
    assert out.outputs[0].token_ids == want
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]  # type: ignore[index]
    expected = [float(logprobs[i, t]) for i, t in enumerate(ids[1:])]
    assert got == pytest.approx(expected, abs=1e-4)


def test_the_unpacker_reads_the_librarys_packing() -> None:
    """compressed-tensors' pack_to_int32, and the reference packers in AWQ's order, read back."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    values = torch.randint(-8, 8, (5, 48), dtype=torch.int8)
    packed = pack_to_int32(values, 4)
    assert torch.equal(unpack_int32(packed, 4, 48) - 8, values.int())
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([5, 48])), values)
    unsigned = torch.randint(0, 16, (3, 16))
    assert torch.equal(unpack_int32(pack_rows(unsigned, 4, AWQ_ORDER), 4, 16, AWQ_ORDER), unsigned.int())


def test_formats_that_cannot_be_read_exactly_are_refused(tmp_path: Path) -> None:
    path, _ = checkpoint(tmp_path / "a", "gptq", 4, 32, True, False)
    config = json.loads(Path(path, "config.json").read_text())
    for change, message in [
        ({"bits": 3}, "quantization_config.bits 3: 4 or 8 bits"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ]:
        qc = {**config["quantization_config"], **change}
        Path(path, "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(UnsupportedModel, match=message):
            LLM(path, kv_cache_memory=8 << 20)
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    Path(path, "config.json").write_text(json.dumps({**config, "quantization_config": awq}))
    with pytest.raises(UnsupportedModel, match="version 'gemv'"):
        LLM(path, kv_cache_memory=8 << 20)
    Path(path, "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="w4a16-g32 already"):
        LLM(path, kv_cache_memory=8 << 20, quantization="fp8")
