"""GGUF checkpoints served quantised: the decoder's projections (and an untied LM head) keep
the file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks in memory, and kernels
dequantise them inside each product: Triton's on CUDA (mmserve/kernels/gguf_gemm.py), a C
library's on the CPU (mmserve/kernels/cpu_gguf.py).

The blocks are the file's bytes, unchanged: uint8 [rows, blocks per row, bytes per block]. A
block's size in bytes names its type (every supported type has its own), so a tensor of blocks
describes itself on its way from the file to the layer. Float tensors (F32 / F16 / BF16) and
the token embedding (a lookup table, and a tied LM head with it) load as floats in the model
dtype. One exception, on by default since session 28: with mmserve.kernels.gguf_gemm.Q6K_ALIGNED on CUDA, Q6_K's
blocks are reordered at load into planes of the same bytes (mmserve/kernels/gguf_planes.py),
2-D, for 16-byte aligned loads. Where the CPU library cannot be built, the CPU keeps the dequantised-at-load path
(mmserve.models.gguf_cache); use_kernels=False multiplies by the gguf package's dequantisation,
the kernels' reference.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.errors import UnsupportedModel
from mmserve.kernels import cpu_lib
from mmserve.models.base import Fp8Model, ModelBase
from mmserve.models.parallel import Shard, TensorParallel, VocabParallelEmbedding

if TYPE_CHECKING:
    from mmserve.models.source import WeightShard

logger = logging.getLogger(__name__)

# mmserve.kernels.* are imported where used (see mmserve.models.fp8); these are the formats of
# mmserve/kernels/gguf_blocks.py: type -> bytes per block
BLOCK_BYTES = {
    "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34,
    "Q4_K": 144, "Q5_K": 176, "Q6_K": 210,
}  # fmt: skip
BLOCK_ELEMENTS = {name: 256 if name.endswith("_K") else 32 for name in BLOCK_BYTES}
SUPPORTED_TYPES = tuple(BLOCK_BYTES)
FLOAT_TYPES = ("F32", "F16", "BF16")
_TYPE_OF_BYTES = {size: name for name, size in BLOCK_BYTES.items()}


def block_type(tensor: torch.Tensor) -> str | None:
    """The GGUF type of a tensor of blocks (uint8 [rows, blocks, bytes]); None for a float one."""
    if tensor.dtype != torch.uint8:
        return None
    if tensor.dim() != 3 or tensor.shape[2] not in _TYPE_OF_BYTES:
        raise UnsupportedModel(
            f"GGUF blocks of shape {list(tensor.shape)}: [rows, blocks, bytes] of one of "
            f"{SUPPORTED_TYPES} expected"
        )
    return _TYPE_OF_BYTES[tensor.shape[2]]


@dataclass(frozen=True)
class _Part:
    """Output rows [start, stop) of a GgufLinear and what holds their weights."""

    start: int
    stop: int
    qtype: str | None  # a GGUF type, or None: a float weight in the model dtype
    buffer: str  # the name of the module's buffer: blocks [rows, blocks, bytes] (Q6_K planes: [rows, bytes]) or [rows, K]
    int8: bool = False  # the buffer holds the blocks repacked for int8 activations (cpu_gguf.q8_pack)


class GgufLinear(nn.Module):
    """y = x W^T + b with W's rows in GGUF blocks. A merged projection (q/k/v, gate/up) may mix
    types (K-quant mixes give attn_v Q6_K beside Q4_K): each run of rows of one type is one
    tensor of blocks and one product; the outputs are concatenated."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype  # of float parts, and of the outputs on the CPU reference path
        self.device = device
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tied = False  # an LM head tied to the embedding: multiplies by its table
        self._loading: dict[int, tuple[int, torch.Tensor]] = {}  # start row -> (stop, tensor)
        self.parts: tuple[_Part, ...] = ()  # set by finish(), in row order
        self._checked: dict[str, int] = {}  # buffer -> its type id, checked at its first CPU product

    @classmethod
    def empty_like(cls, linear: nn.Linear, device: torch.device) -> GgufLinear:
        """(linear's bias, on the meta device with it, gets storage with the model's.)"""
        bias = None if linear.bias is None else torch.zeros_like(linear.bias)
        return cls(linear.in_features, linear.out_features, bias, linear.weight.dtype, device)

    def load_rows(self, tensor: torch.Tensor, name: str, rows: slice | None = None) -> None:
        """Takes the checkpoint tensor `name` (blocks, or float [rows, K]) for rows (None: all)."""
        start, stop = (0, self.out_features) if rows is None else (rows.start, rows.stop)
        qtype = block_type(tensor)
        k = self.in_features if qtype is None else tensor.shape[1] * BLOCK_ELEMENTS[qtype]
        if tensor.shape[0] != stop - start or k != self.in_features:
            raise UnsupportedModel(
                f"weight {name}: checkpoint shape {[tensor.shape[0], k]} != model "
                f"{[stop - start, self.in_features]}"
            )
        if start in self._loading:
            raise UnsupportedModel(f"weight {name}: rows {start}-{stop} are loaded twice")
        dtype = torch.uint8 if qtype is not None else self.dtype
        self._loading[start] = (stop, tensor.to(self.device, dtype).contiguous())

    def finish(self, embedding: GgufEmbedding | None = None) -> None:
        """After loading: joins adjacent rows of one type into one tensor of blocks; rows that
        no checkpoint tensor filled fail naming the layer's rows. A tied head takes the
        embedding's table (the same tensor, not a copy)."""
        if self.tied:
            if embedding is None or embedding.table is None:
                raise UnsupportedModel("a tied LM head without a loaded GGUF embedding")
            self.register_buffer("part0", embedding.table)
            self.parts = (_Part(0, self.out_features, embedding.qtype, "part0"),)
            self._checked.clear()
            return
        runs: list[tuple[int, int, str | None, list[torch.Tensor]]] = []
        at = 0
        for start in sorted(self._loading):
            stop, tensor = self._loading[start]
            if start != at:
                break
            qtype = block_type(tensor)
            if runs and runs[-1][2] == qtype:
                runs[-1] = (runs[-1][0], stop, qtype, [*runs[-1][3], tensor])
            else:
                runs.append((start, stop, qtype, [tensor]))
            at = stop
        if at != self.out_features:
            raise UnsupportedModel(
                f"GGUF layer of {self.out_features} x {self.in_features}: the checkpoint "
                f"fills rows up to {at} only"
            )
        parts = []
        for i, (start, stop, qtype, tensors) in enumerate(runs):
            blocks = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
            if qtype == "Q6_K" and aligns_q6k(self.device):
                from mmserve.kernels.gguf_planes import q6k_planes

                blocks = q6k_planes(blocks)
            self.register_buffer(f"part{i}", blocks)
            parts.append(_Part(start, stop, qtype, f"part{i}"))
        self.parts = tuple(parts)
        self._loading.clear()
        self._checked.clear()

    def take_int8_activations(self) -> int:
        """On the CPU: the parts whose type the C library multiplies with int8 activations here
        (cpu_gguf.q8_supported) are repacked for it, in place of their blocks (a tied head's
        copy: the embedding keeps its table); returns how many."""
        from mmserve.kernels import cpu_gguf

        if self.device.type != "cpu" or not cpu_lib.available():
            return 0
        parts, taken = [], 0
        for part in self.parts:
            if part.qtype is not None and not part.int8 and cpu_gguf.q8_supported(part.qtype):
                self.register_buffer(part.buffer, cpu_gguf.q8_pack(self.get_buffer(part.buffer), part.qtype))
                part, taken = replace(part, int8=True), taken + 1
            parts.append(part)
        self.parts = tuple(parts)
        self._checked.clear()
        return taken

    def forward(self, x: torch.Tensor, use_kernels: bool | None = None) -> torch.Tensor:
        """use_kernels: True the Triton path (tests set it under the interpreter), False the
        reference; by default Triton on CUDA, the C library on the CPU where it built."""
        path = _path(x, use_kernels)
        if x.dim() == 2 and len(self.parts) == 1 and self.bias is None:  # (a step's usual call)
            return self._product(x, self.parts[0], path)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        outs = [self._product(x2, part, path) for part in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor, part: _Part, path: str) -> torch.Tensor:
        weight = self._buffers[part.buffer]  # (set by finish())
        assert weight is not None
        if part.qtype is None:
            return F.linear(x, weight)
        if part.int8:
            from mmserve.kernels import cpu_gguf
            from mmserve.kernels.gguf_blocks import FORMATS

            if path != "cpu":
                raise ValueError("a part repacked for int8 activations has the C library's product only")
            return cpu_gguf.q8_gemm(x, weight, FORMATS[part.qtype].type_id, part.stop - part.start)
        if path == "triton":
            from mmserve.kernels.gguf_gemm import gguf_matmul

            return gguf_matmul(x.contiguous(), weight, part.qtype)
        if path == "cpu":
            from mmserve.kernels import cpu_gguf

            type_id = self._checked.get(part.buffer)
            if type_id is None:  # (the blocks do not change after finish(): checked once)
                type_id = self._checked[part.buffer] = cpu_gguf.check(weight, part.qtype, self.in_features)
            return cpu_gguf.gemm_checked(x, weight, part.qtype, type_id)
        from mmserve.kernels.gguf_blocks import gguf_dequantize_ref

        return (x.float() @ gguf_dequantize_ref(weight, part.qtype).t()).to(x.dtype)

    def qtypes(self) -> set[str]:
        return {p.qtype for p in self.parts if p.qtype is not None}

    def held_bytes(self) -> dict[str, int]:
        """Bytes of blocks per GGUF type (a tied head's are the embedding's: none here)."""
        held: dict[str, int] = {}
        for p in self.parts:
            if p.qtype is not None and not self.tied:
                # (a part repacked for int8 activations counts its blocks' bytes, Q6_K planes their own)
                nbytes = (p.stop - p.start) * self.in_features // BLOCK_ELEMENTS[p.qtype] * BLOCK_BYTES[p.qtype]
                held[p.qtype] = held.get(p.qtype, 0) + (nbytes if p.int8 else self.get_buffer(p.buffer).numel())
        return held

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{p.start}-{p.stop} {p.qtype or self.dtype}{' a8' if p.int8 else ''}" for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, gguf {kinds}"


class GgufEmbedding(nn.Module):
    """The token embedding as GGUF blocks [vocab, blocks, bytes] (or a float table): a lookup
    dequantises only the rows it reads. Split over the vocabulary (tp: VocabParallelEmbedding's
    rows from `start`), each rank looks up the ids it holds, zeros for the others, and one
    all-reduce sums them."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel | None = None, start: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype, self.device = dtype, device
        self.tp, self.start = tp, start
        self.qtype: str | None = None  # the table's GGUF type; None: float
        self.table: torch.Tensor | None
        self.register_buffer("table", None)  # [vocab, blocks, bytes] or [vocab, dim], loaded

    @classmethod
    def empty_like(
        cls, embedding: nn.Embedding | VocabParallelEmbedding, device: torch.device
    ) -> GgufEmbedding:
        """Of an nn.Embedding, or a VocabParallelEmbedding (its rank's rows)."""
        rows, dim = embedding.weight.shape
        if isinstance(embedding, VocabParallelEmbedding):
            return cls(rows, dim, embedding.weight.dtype, device, embedding.tp, embedding.start)
        return cls(rows, dim, embedding.weight.dtype, device)

    def load_rows(self, tensor: torch.Tensor, name: str, rows: slice | None = None) -> None:
        qtype = block_type(tensor)
        dim = tensor.shape[1] * BLOCK_ELEMENTS[qtype] if qtype is not None else tensor.shape[1]
        if rows is not None or [tensor.shape[0], dim] != [self.num_embeddings, self.embedding_dim]:
            raise UnsupportedModel(
                f"weight {name}: checkpoint shape {[tensor.shape[0], dim]} != model "
                f"{[self.num_embeddings, self.embedding_dim]}"
            )
        self.qtype = qtype
        dtype = torch.uint8 if qtype is not None else self.dtype
        self.register_buffer("table", tensor.to(self.device, dtype).contiguous())

    def finish(self) -> None:
        if self.table is None:
            raise UnsupportedModel("the checkpoint lacks the token embedding")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., dim]
        if self.tp is None:
            return self._lookup(ids)
        local = ids - self.start
        held = (local >= 0) & (local < self.num_embeddings)
        x = self._lookup(local.clamp(0, self.num_embeddings - 1))
        return self.tp.all_reduce(x * held.unsqueeze(-1).to(x.dtype))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.table is not None  # finish() checked it
        if self.qtype is None:
            return F.embedding(ids, self.table)
        rows = self.table.index_select(0, ids.reshape(-1))
        path = _path(rows, None)
        if path == "triton":
            from mmserve.kernels.gguf_blocks import gguf_dequantize

            out = gguf_dequantize(rows, self.qtype, self.dtype)
        elif path == "cpu":
            from mmserve.kernels.cpu_gguf import gguf_dequantize_cpu

            out = gguf_dequantize_cpu(rows, self.qtype).to(self.dtype)
        else:
            from mmserve.kernels.gguf_blocks import gguf_dequantize_ref

            out = gguf_dequantize_ref(rows, self.qtype).to(self.dtype)
        return out.view(*ids.shape, self.embedding_dim)

    def held_bytes(self) -> dict[str, int]:
        if self.qtype is None or self.table is None:
            return {}
        return {self.qtype: self.table.numel()}

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, gguf {self.qtype or self.dtype}"


def aligns_q6k(device: torch.device) -> bool:
    """Whether Q6_K's blocks load onto device in planes (gguf_gemm.Q6K_ALIGNED, CUDA only: the CPU
    library reads the file's blocks)."""
    if device.type != "cuda":
        return False
    from mmserve.kernels import gguf_gemm

    return gguf_gemm.Q6K_ALIGNED


def _path(x: torch.Tensor, use_kernels: bool | None) -> str:
    """Which product multiplies x by blocks: "triton", "cpu" (the C library) or "reference"."""
    if use_kernels is not None:
        return "triton" if use_kernels else "reference"
    if x.is_cuda:
        return "triton"
    return "cpu" if cpu_lib.available() else "reference"


def cpu_kernels_available() -> bool:
    """The CPU's C library built on this machine (the loader keeps blocks on the CPU then)."""
    return cpu_lib.available()


@torch.no_grad()
def prepare_gguf(model: ModelBase, device: torch.device) -> int:
    """Before a GGUF's weights load (on a model built on the meta device, so that no float
    copy of them is ever made): the decoder layers' projections and the LM head become empty
    GgufLinear, the token embedding an empty GgufEmbedding (a tied head multiplies by its
    table), whose blocks will load onto device; returns how many modules were replaced.
    Under tensor parallelism the embedding (a VocabParallelEmbedding) and the head keep their
    rank's vocabulary rows of blocks, the last rank's padded with zero blocks (zeros in every
    type)."""
    if not model.capabilities.supports_fp8:  # the decoders whose projections can be swapped
        raise UnsupportedModel(f"GGUF blocks are not kept for {type(model).__name__}")
    embeddings = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, (nn.Embedding, VocabParallelEmbedding))
    ]
    tied_weights = {id(e.weight) for _, _, e in embeddings}
    linears = [
        (parent, name, child)
        for layer in cast(Fp8Model, model).decoder_layers()
        for parent in layer.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    head = dict(model.named_children()).get("lm_head")
    if isinstance(head, nn.Linear):
        linears.append((model, "lm_head", head))
    for parent, name, linear in linears:
        replacement = GgufLinear.empty_like(linear, device)
        replacement.tied = id(linear.weight) in tied_weights
        setattr(parent, name, replacement)
    for parent, name, embedding in embeddings:
        setattr(parent, name, GgufEmbedding.empty_like(embedding, device))
    return len(linears) + len(embeddings)


def shard_blocks(
    weights: Iterable[tuple[str, torch.Tensor]], shard: WeightShard
) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_gguf_blocks' tensors cut to a tensor-parallel rank's parts (shard: of each
    tensor's float shape). Blocks stay blocks where the cut falls on their bounds (output rows,
    the last rank's vocabulary rows padded with zero blocks; input columns at multiples of the
    type's block), else they are dequantised, then cut (a row-parallel projection whose rank's
    columns end inside a block: K-quants' 256 at a small width)."""
    from mmserve.kernels.gguf_blocks import gguf_dequantize_ref

    for name, tensor in weights:
        qtype = block_type(tensor)
        elements = 1 if qtype is None else BLOCK_ELEMENTS[qtype]
        shape = (tensor.shape[0], tensor.shape[1] * elements) if qtype else tuple(tensor.shape)
        part = shard(name, shape)
        if part is None:
            yield name, tensor
            continue
        cut = None if qtype is None else _cut_blocks(tensor, part, elements, shape)
        if cut is None:
            floats = tensor if qtype is None else gguf_dequantize_ref(tensor, qtype)
            cut = part.read(floats, shape)
        yield name, cut


def _cut_blocks(
    blocks: torch.Tensor, part: Shard, elements: int, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The part of a weight's blocks (uint8 [N, K / elements, bytes]; shape: [N, K]), where it
    is whole blocks."""
    if part.zero:
        return None
    size = shape[part.dim]
    stop = size if part.stop is None else min(part.stop, size)
    if part.dim == 0:
        rows = blocks[part.start : stop]
        short = 0 if part.pad_to is None else part.pad_to - rows.shape[0]
        return torch.cat([rows, rows.new_zeros(short, *rows.shape[1:])]) if short > 0 else rows
    if part.pad_to is not None:
        return None
    if part.start % elements or stop % elements:
        return None
    return blocks[:, part.start // elements : stop // elements]


def finish_gguf(model: nn.Module, int8_activations: bool = False) -> None:
    """After the weights loaded: every GgufLinear joins its parts (and checks it is full); a
    tied head takes the embedding's table. int8_activations: then the CPU's parts that the C
    library multiplies with int8 activations are repacked for it (GgufLinear.take_int8_activations)."""
    embeddings = [m for m in model.modules() if isinstance(m, GgufEmbedding)]
    for embedding in embeddings:
        embedding.finish()
    taken = 0
    for module in model.modules():
        if isinstance(module, GgufLinear):
            module.finish(embeddings[0] if module.tied and len(embeddings) == 1 else None)
            taken += module.take_int8_activations() if int8_activations else 0
    if int8_activations and taken:
        logger.info("GGUF: %d products take int8 activations (--cpu-gguf-activations int8)", taken)
    elif int8_activations:
        logger.warning(
            "--cpu-gguf-activations int8: no product takes them here (they need the CPU's C "
            "library with AVX-512 VNNI); float32 instead"
        )


def takes_int8_activations(model: Any) -> bool:  # an nn.Module
    """Whether any of the model's GGUF products runs on int8 activations (--cpu-gguf-activations
    int8, where it took)."""
    return any(p.int8 for m in model.modules() if isinstance(m, GgufLinear) for p in m.parts)


def gguf_quantization(model: Any) -> str:  # an nn.Module (the engine holds a CausalLM)
    """The GGUF types the model keeps as blocks, the most bytes first: "gguf:Q4_1+Q8_0" for
    SmolLM2 (Q4_1 layers, a Q8_0 embedding and tied head); "" when it keeps none."""
    held: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (GgufLinear, GgufEmbedding)):
            for qtype, nbytes in module.held_bytes().items():
                held[qtype] = held.get(qtype, 0) + nbytes
    return "gguf:" + "+".join(sorted(held, key=lambda t: -held[t])) if held else ""
