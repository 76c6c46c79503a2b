"""Weight-only int4/int8 checkpoints: compressed-tensors `pack-quantized` (w4a16, w8a16;
symmetric or asymmetric; groups of 32-128 or one per channel; act-order g_idx), GPTQ (qweight /
qzeros / scales, with and without act-order g_idx; the v1 format's zeros stored minus one) and
AWQ's GEMM packing, detected from config.json's quantization_config.

Each quantised projection is unpacked to its integer weights, zero points and scales:
w[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)] with g(i) the input channel's group (i //
group_size, or g_idx[i]). On the CPU it is dequantised as it loads, so the model's outputs
are those of the dequantised weights (what transformers computes on them). On CUDA each
projection is instead repacked into mmserve/kernels/wna16.py's layout (a merged q/k/v or gate/up from
its parts) before the float weights load, on a model built on the meta device, and is never
dequantised: WeightOnlyLinear runs the product from the packed weight, and the load's peak
is about the packed model. ListModels names the format (e.g. "w4a16-g128"). A format that
cannot be read exactly is refused, naming the config field."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mmserve.errors import UnsupportedModel
from mmserve.models.fp8 import check_kv_cache_scheme, config_group
from mmserve.models.parallel import Shard

if TYPE_CHECKING:
    from mmserve.models.source import WeightShard

# AWQ's GEMM packing: nibble k of a word holds output column 8 * word + AWQ_ORDER[k]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class WeightOnlyCheckpoint:
    format: str  # "compressed-tensors", "gptq" or "awq"
    bits: int  # 4 or 8
    group_size: int  # 0: one group per output channel (all its input channels)
    symmetric: bool
    gptq_v1: bool = False  # GPTQ's first format: zeros stored minus one

    @property
    def scheme(self) -> str:
        """As ListModels names it: w4a16-g128, w8a16 (per channel), ..."""
        group = f"-g{self.group_size}" if self.group_size else ""
        return f"w{self.bits}a16{group}"


def checkpoint_weight_only(hf_config: Any) -> WeightOnlyCheckpoint | None:
    """The weight-only scheme of a checkpoint's quantization_config; None when it has none
    or another kind (FP8: models/fp8.py). One that cannot be read exactly raises."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        return _compressed_tensors(qc)
    return None


def _bits(where: str, bits: Any) -> int:
    if bits not in (4, 8):
        raise UnsupportedModel(f"{where} {bits!r}: 4 or 8 bits are read")
    return int(bits)


def _group(where: str, size: Any) -> int:
    if size in (None, -1, 0):
        return 0
    if not isinstance(size, int) or size < 1:
        raise UnsupportedModel(f"{where} {size!r}: a positive group size or -1 expected")
    return size


def _gptq(qc: dict) -> WeightOnlyCheckpoint:
    where = "quantization_config"
    form = qc.get("checkpoint_format", "gptq")
    if form not in ("gptq", "gptq_v2"):
        raise UnsupportedModel(f"{where}.checkpoint_format {form!r}: gptq or gptq_v2 expected")
    return WeightOnlyCheckpoint(
        "gptq",
        _bits(f"{where}.bits", qc.get("bits")),
        _group(f"{where}.group_size", qc.get("group_size")),
        bool(qc.get("sym", True)),
        gptq_v1=form == "gptq",
    )


def _awq(qc: dict) -> WeightOnlyCheckpoint:
    where = "quantization_config"
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModel(f"{where}.version {version!r}: AWQ's GEMM packing is read")
    bits = _bits(f"{where}.bits", qc.get("bits", qc.get("w_bit")))
    if bits != 4:
        raise UnsupportedModel(f"{where}.bits {bits}: AWQ's GEMM packing is 4-bit")
    group = _group(f"{where}.group_size", qc.get("group_size", qc.get("q_group_size")))
    return WeightOnlyCheckpoint("awq", bits, group, not qc.get("zero_point", True))


def _compressed_tensors(qc: dict) -> WeightOnlyCheckpoint:
    where = "quantization_config"
    group = config_group(qc)
    if group.get("input_activations"):
        raise UnsupportedModel(
            f"{where}.config_groups input_activations: pack-quantized activations are not read"
        )
    weights = group.get("weights") or {}
    if weights.get("type", "int") != "int" or weights.get("dynamic"):
        raise UnsupportedModel(f"{where} weights {weights}: static int weights expected")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise UnsupportedModel(f"{where} weights.strategy {strategy!r}: group or channel expected")
    size = _group(f"{where} weights.group_size", weights.get("group_size")) if strategy == "group" else 0
    if strategy == "group" and not size:
        raise UnsupportedModel(f"{where} weights.group_size: a group strategy needs one")
    check_kv_cache_scheme(qc)
    return WeightOnlyCheckpoint(
        "compressed-tensors",
        _bits(f"{where} weights.num_bits", weights.get("num_bits")),
        size,
        bool(weights.get("symmetric", True)),
    )


# --- unpacking -----------------------------------------------------------------------------


def unpack_int32(packed: torch.Tensor, bits: int, count: int, order: tuple[int, ...] = ()) -> torch.Tensor:
    """[rows, words] int32 -> [rows, count] int32 unsigned values; value j of a row sits at
    bits (j % per) * bits of word j // per (per = 32 // bits), or, with an order, value
    per * word + order[k] at slot k."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per]
    if order:
        values = values[..., torch.tensor([order.index(k) for k in range(per)])]
    return values.flatten(1)[:, :count]


def _groups_of(checkpoint: WeightOnlyCheckpoint, in_features: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Each input channel's group: g_idx (act order), else i // group_size (0 per channel)."""
    if g_idx is not None:
        return g_idx.long()
    size = checkpoint.group_size or in_features
    return torch.arange(in_features) // size


@dataclass
class Unpacked:
    """One projection's weight as integers: w[o, i] = (q[o, i] - zeros[o, g]) * scales[o, g]
    with g = groups[i]; q and zeros unsigned, in [0, 2^bits)."""

    q: torch.Tensor  # [out, in] int32
    zeros: torch.Tensor  # [out, groups] int32
    scales: torch.Tensor  # [out, groups] as the checkpoint stores them
    groups: torch.Tensor  # [in] int64

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        g = self.groups
        return (self.q.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]

    def cut(self, shard: Shard) -> Unpacked | None:
        """A tensor-parallel rank's part of the weight (shard: of the [out, in] float weight):
        its output channels (with their zeros and scales), or its input channels (with the
        groups they use, renumbered from 0); None for a part a float weight alone can be
        (zeros, or padded rows)."""
        if shard.zero or shard.pad_to is not None:
            return None
        if shard.dim == 0:
            rows = slice(shard.start, shard.stop)
            return Unpacked(self.q[rows], self.zeros[rows], self.scales[rows], self.groups)
        groups = self.groups[shard.start : shard.stop]
        used = torch.unique(groups)  # (sorted)
        return Unpacked(
            self.q[:, shard.start : shard.stop],
            self.zeros[:, used],
            self.scales[:, used],
            torch.searchsorted(used, groups),
        )


def quantised_part(name: str, checkpoint: WeightOnlyCheckpoint) -> tuple[str, str] | None:
    """(the projection's prefix, the part's name) when the tensor `name` is a quantised
    projection's part; None for a tensor that loads as it is."""
    prefix, _, part = name.rpartition(".")
    return (prefix, part) if part in _PARTS[checkpoint.format] else None


def dequantize_weight_only(
    weights: Iterable[tuple[str, torch.Tensor]], checkpoint: WeightOnlyCheckpoint
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with every quantised projection's parts replaced
    by its dequantised float32 weight (name.weight); other tensors pass as they are."""
    parts = _PARTS[checkpoint.format]
    unpack = _UNPACK[checkpoint.format]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        found = quantised_part(name, checkpoint)
        if found is None:
            yield name, tensor
            continue
        prefix, part = found
        have = pending.setdefault(prefix, {})
        have[part] = tensor
        if parts <= have.keys():  # (else an optional part, g_idx, may still come)
            yield f"{prefix}.weight", unpack(prefix, pending.pop(prefix), checkpoint).dequantize()
    for prefix, have in _complete(pending, checkpoint).items():
        yield f"{prefix}.weight", unpack(prefix, have, checkpoint).dequantize()


def packed_parts(
    weights: Iterable[tuple[str, torch.Tensor]], checkpoint: WeightOnlyCheckpoint
) -> dict[str, dict[str, torch.Tensor]]:
    """The quantised projections' parts among weights, by prefix then part name (other
    tensors are passed over): what pack_weight_only repacks."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        where = quantised_part(name, checkpoint)
        if where is not None:
            found.setdefault(where[0], {})[where[1]] = tensor
    return _complete(found, checkpoint)


def _complete(
    found: dict[str, dict[str, torch.Tensor]], checkpoint: WeightOnlyCheckpoint
) -> dict[str, dict[str, torch.Tensor]]:
    """found, after checking that every projection in it has its required parts."""
    required = _required(checkpoint)
    for prefix, have in found.items():
        missing = sorted(set(required) - set(have))
        if missing:
            raise UnsupportedModel(f"{prefix}: quantised weight without {', '.join(missing)}")
    return found


_PARTS = {
    "compressed-tensors": {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"},
    "gptq": {"qweight", "qzeros", "scales", "g_idx"},
    "awq": {"qweight", "qzeros", "scales"},
}


def _required(checkpoint: WeightOnlyCheckpoint) -> tuple[str, ...]:
    if checkpoint.format == "compressed-tensors":
        zero = () if checkpoint.symmetric else ("weight_zero_point",)
        return ("weight_packed", "weight_scale", "weight_shape", *zero)
    return ("qweight", "qzeros", "scales")


def _compressed(prefix: str, t: dict[str, torch.Tensor], c: WeightOnlyCheckpoint) -> Unpacked:
    """compressed-tensors: weight_packed [out, ceil(in * bits / 32)] holds q + 2^(bits-1)
    along each row; weight_zero_point (asymmetric) [ceil(out * bits / 32), groups] packed
    the same way along the columns; weight_scale [out, groups]."""
    out_features, in_features = (int(x) for x in t["weight_shape"].tolist())
    offset = 1 << (c.bits - 1)
    q = unpack_int32(t["weight_packed"], c.bits, in_features)  # (q + offset: unsigned)
    scales = t["weight_scale"]
    if scales.shape[0] != out_features:
        raise UnsupportedModel(f"{prefix}.weight_scale: shape {tuple(scales.shape)} for {out_features} rows")
    zeros = torch.full_like(scales, offset, dtype=torch.int32)
    if not c.symmetric:
        packed = t["weight_zero_point"]
        zeros = unpack_int32(packed.t().contiguous(), c.bits, out_features).t()
    return Unpacked(q, zeros, scales, _groups_of(c, in_features, t.get("weight_g_idx")))


def _gptq_weight(prefix: str, t: dict[str, torch.Tensor], c: WeightOnlyCheckpoint) -> Unpacked:
    """GPTQ: qweight [in / per, out] packs input channels; qzeros [groups, out / per] packs
    output channels (v1: zero - 1 stored); scales [groups, out]; g_idx [in] (act order)."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    out_features = scales.shape[1]
    in_features = qweight.shape[0] * (32 // c.bits)
    q = unpack_int32(qweight.t().contiguous(), c.bits, in_features)  # [out, in]
    zeros = unpack_int32(qzeros, c.bits, out_features).t()  # [out, groups]
    if c.gptq_v1:
        zeros = zeros + 1
    g_idx = t.get("g_idx")
    if g_idx is not None and c.group_size and torch.equal(g_idx.long(), _groups_of(c, in_features, None)):
        g_idx = None  # (the plain order, written out)
    return Unpacked(q, zeros, scales.t(), _groups_of(c, in_features, g_idx))


def _awq_weight(prefix: str, t: dict[str, torch.Tensor], c: WeightOnlyCheckpoint) -> Unpacked:
    """AWQ GEMM: qweight [in, out / 8] and qzeros [groups, out / 8] pack output channels in
    AWQ_ORDER; scales [groups, out]; no zero points (symmetric): 8."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    out_features = scales.shape[1]
    q = unpack_int32(qweight, c.bits, out_features, AWQ_ORDER).t()  # [out, in]
    zeros = unpack_int32(qzeros, c.bits, out_features, AWQ_ORDER).t()
    if c.symmetric:
        zeros = torch.full_like(zeros, 1 << (c.bits - 1))
    return Unpacked(q, zeros, scales.t(), _groups_of(c, q.shape[1], None))


_UNPACK = {"compressed-tensors": _compressed, "gptq": _gptq_weight, "awq": _awq_weight}


# --- kept packed (the w4a16 / w8a16 kernel, mmserve/kernels/wna16.py) --------------------------------


class WeightOnlyLinear(nn.Module):
    """y = x W^T + b with W kept packed: mmserve/kernels/wna16.py's layout (qweight [K / per, N],
    scales and zeros [groups, N]; zeros None for a symmetric weight, whose zero points are all
    2^(bits - 1): the kernel then reads none); an act-order checkpoint's input channels permuted
    so that its groups are contiguous, and x permuted the same way (perm)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        bits: int,
        group_size: int,
        perm: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.in_features, self.out_features = qweight.shape[0] * (32 // bits), qweight.shape[1]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("perm", perm)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_unpacked(
        cls, u: Unpacked, bits: int, dtype: torch.dtype, bias: torch.Tensor | None = None
    ) -> WeightOnlyLinear:
        """Repacks one projection; ValueError when its groups cannot be made contiguous runs
        of one size (then keep it dequantised)."""
        from mmserve.kernels.wna16 import pack_columns

        groups, q = u.groups, u.q
        perm = None
        if not bool((groups[1:] >= groups[:-1]).all()):  # act order
            perm = torch.argsort(groups, stable=True)
            groups, q = groups[perm], q[:, perm]
        counts = torch.bincount(groups)
        size = int(counts[0])
        if not bool((counts[:-1] == size).all()) or int(counts[-1]) > size:
            raise ValueError("the groups are not runs of one size")
        symmetric = bool((u.zeros == 1 << (bits - 1)).all())
        return cls(
            pack_columns(q.t().contiguous(), bits),
            u.scales.t().to(dtype).contiguous(),
            None if symmetric else u.zeros.t().to(dtype).contiguous(),
            bits,
            size,
            perm,
            bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from mmserve.kernels.wna16 import wna16_gemm

        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        out = wna16_gemm(x2.contiguous(), self.qweight, self.scales, self.zeros, self.bits, self.group_size)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)


# device types whose weight-only projections stay packed (the Triton kernel); tests add "cpu"
# under the Triton interpreter
PACKED_ON = ("cuda",)
# a merged projection of ours -> the checkpoint's projections it holds, in row order
_MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@torch.no_grad()
def pack_weight_only(
    model: nn.Module,
    parts: dict[str, dict[str, torch.Tensor]],
    checkpoint: WeightOnlyCheckpoint,
    dtype: torch.dtype,
    device: torch.device,
    shard: WeightShard | None = None,
) -> set[str]:
    """Before the float weights load (on a model built on the meta device, so that no float
    copy of a packed projection is ever made): every nn.Linear whose checkpoint projections'
    parts (packed_parts) are all in parts becomes a WeightOnlyLinear of those parts on device
    (a merged one's concatenated along the output channels), keeping the linear's bias, which
    loads with the float weights. Returns the checkpoint prefixes packed (their parts leave
    parts). A projection whose parts are missing (a checkpoint naming its modules otherwise)
    or whose parts' groups differ stays an nn.Linear, to load its dequantised weight.

    shard (tensor parallelism): each projection is cut to this rank's part of its float
    weight (Unpacked.cut) before it is repacked. A row-parallel part whose input channels do
    not hold whole groups of one size (an act-order checkpoint's, or a cut inside a group)
    stays an nn.Linear, to load its part of the dequantised weight."""
    unpack = _UNPACK[checkpoint.format]

    def unpacked(prefix: str) -> Unpacked | None:
        u = unpack(prefix, parts[prefix], checkpoint)
        part = None if shard is None else shard(f"{prefix}.weight", tuple(u.q.shape))
        return u if part is None else u.cut(part)

    packed: set[str] = set()
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            base = f"{path}.{name}" if path else name
            prefixes = [
                f"{path}.{part}" if path else part for part in _MERGED_PARTS.get(name, ())
            ] or [base]
            if not all(p in parts for p in prefixes):
                continue
            cut = [unpacked(p) for p in prefixes]
            if any(u is None for u in cut):
                continue
            ours = [u for u in cut if u is not None]
            if any(not torch.equal(u.groups, ours[0].groups) for u in ours):
                continue
            whole = Unpacked(
                torch.cat([u.q for u in ours]),
                torch.cat([u.zeros for u in ours]),
                torch.cat([u.scales for u in ours]),
                ours[0].groups,
            )
            try:
                layer = WeightOnlyLinear.from_unpacked(whole, checkpoint.bits, dtype).to(device)
            except ValueError:
                continue
            if (layer.in_features, layer.out_features) != (child.in_features, child.out_features):
                raise UnsupportedModel(
                    f"{base}: the checkpoint's weight is {layer.out_features} x {layer.in_features}, "
                    f"the model's {child.out_features} x {child.in_features}"
                )
            layer.bias = child.bias
            setattr(parent, name, layer)
            for p in prefixes:
                del parts[p]  # (the host's copy of the packed weight goes as soon as it is used)
            packed.update(prefixes)
    return packed
