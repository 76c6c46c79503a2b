"""Tensor parallelism as the models see it: which rank this is, the collectives of its group,
which rows or columns of each checkpoint tensor it holds, and the vocab-parallel embedding.

A model is built inside `tensor_parallel(tp)` (mmserve.models.loader does it) and its layers
read `current()` once, at construction, to size their shards; built outside (size 1) every
layer is the plain nn.Linear / nn.Embedding it always was, and no collective runs. The group
is a torch.distributed ProcessGroup made for this model alone (gloo on CPU, NCCL on CUDA), not
the global default group, so one server can hold several tensor-parallel models.

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes its heads, its
share of the intermediate size), o and down are row-parallel (each rank's partial product,
summed by one all-reduce); embedding and LM head are split over the vocabulary. A row-parallel
bias is held by rank 0 only (zeros elsewhere), so the all-reduce adds it once.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.errors import RankLost, UnsupportedModel

STARTUP_TIMEOUT = datetime.timedelta(seconds=600)  # loading weights on the slowest rank


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a model's tensor-parallel group."""

    rank: int
    size: int
    group: Any = None  # torch.distributed ProcessGroup; None: loading only (tests), no collectives
    device: str = "cpu"  # where the group's tensors live (cuda:N for NCCL)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, in place."""
        _wait(self.group.allreduce([x]))
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n]: the ranks' parts side by side, in order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _wait(self.group.allgather([parts], [x.contiguous()]))
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of the ranks' values (every rank calls it). It waits for the slowest
        rank up to STARTUP_TIMEOUT, not the group's timeout: ranks meet here once loaded."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # the stubs' RedOpType
        opts.timeout = STARTUP_TIMEOUT
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        _wait(self.group.allreduce([x], opts))
        return int(x.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        _wait(self.group.broadcast(x, 0))
        return x


def _wait(work: Any) -> None:
    """Waits for a collective; RankLost when a rank is gone (its socket closed) or the wait
    passed the group's timeout (gloo raises both as RuntimeError; NCCL's watchdog aborts)."""
    try:
        work.wait()
    except RuntimeError as e:
        raise RankLost(f"a collective between tensor-parallel ranks failed: {e}") from e


_CURRENT: ContextVar[TensorParallel | None] = ContextVar("mmserve_tensor_parallel", default=None)


@contextmanager
def tensor_parallel(tp: TensorParallel | None) -> Iterator[None]:
    """Models built inside are sharded for tp (None or size 1: not sharded)."""
    token = _CURRENT.set(tp if tp is not None and tp.size > 1 else None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> TensorParallel | None:
    """The group of the model being built; None when it is not sharded."""
    return _CURRENT.get()


def divide(total: int, size: int, what: str) -> int:
    """total // size; UnsupportedModel saying why when it does not divide."""
    if total % size:
        raise UnsupportedModel(
            f"tensor_parallel_size {size} does not divide {what} ({total}); choose a size that "
            f"divides it"
        )
    return total // size


@dataclass(frozen=True)
class KVHeads:
    """The KV heads one rank holds: split when there are at least as many as ranks, else
    each rank holds one, shared by size // num_kv_heads ranks (as vLLM replicates them)."""

    first: int  # index of the rank's first KV head in the checkpoint
    count: int  # KV heads on the rank

    @staticmethod
    def of(num_kv_heads: int, tp: TensorParallel) -> KVHeads:
        if num_kv_heads >= tp.size:
            count = divide(num_kv_heads, tp.size, "the number of KV heads")
            return KVHeads(tp.rank * count, count)
        if tp.size % num_kv_heads:
            raise UnsupportedModel(
                f"tensor_parallel_size {tp.size} with {num_kv_heads} KV heads: with fewer KV "
                f"heads than ranks, the ranks must be a multiple of the KV heads (each is "
                f"replicated on size / KV heads ranks)"
            )
        return KVHeads(tp.rank * num_kv_heads // tp.size, 1)


@dataclass(frozen=True)
class Shard:
    """The part of one checkpoint tensor a rank holds: [start, stop) along dim, zero-padded to
    pad_to rows (the last rank's vocabulary rows); zero: the rank holds zeros of the full
    shape (a row-parallel bias off rank 0)."""

    dim: int = 0
    start: int = 0
    stop: int | None = None
    pad_to: int | None = None
    zero: bool = False

    def read(self, source: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """The part, read from source: a tensor or a safetensors slice (PySafeSlice), which
        then reads only these bytes from the file."""
        if self.zero:
            return torch.zeros(shape, dtype=_dtype_of(source))
        stop = shape[self.dim] if self.stop is None else min(self.stop, shape[self.dim])
        index = (slice(None),) * self.dim + (slice(self.start, stop),)
        part = source[index]
        if self.pad_to is not None and part.shape[0] < self.pad_to:
            part = torch.cat([part, part.new_zeros(self.pad_to - part.shape[0], *part.shape[1:])])
        return part


def _dtype_of(source: Any) -> torch.dtype:
    if isinstance(source, torch.Tensor):
        return source.dtype
    from safetensors.torch import _getdtype  # the slice's dtype name -> torch dtype

    return _getdtype(source.get_dtype())  # type: ignore[no-any-return]


def rows(tp: TensorParallel, per_rank: int) -> Shard:
    """The rank's per_rank rows (column-parallel weights, their biases and scales)."""
    return Shard(0, tp.rank * per_rank, (tp.rank + 1) * per_rank)


def columns(tp: TensorParallel, per_rank: int) -> Shard:
    """The rank's per_rank input columns (row-parallel weights)."""
    return Shard(1, tp.rank * per_rank, (tp.rank + 1) * per_rank)


def vocab_rows(tp: TensorParallel, vocab_size: int) -> Shard:
    """The rank's vocabulary rows, padded: rank r holds [r * n, (r + 1) * n), n = ceil(V / size)."""
    per_rank = -(-vocab_size // tp.size)
    return Shard(0, tp.rank * per_rank, (tp.rank + 1) * per_rank, pad_to=per_rank)


def first_rank_only(tp: TensorParallel) -> Shard | None:
    """A row-parallel bias: whole on rank 0, zeros elsewhere (the all-reduce adds it once)."""
    return None if tp.rank == 0 else Shard(zero=True)


def reduce(tp: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's partial sums, summed over the ranks (x itself unsharded)."""
    return x if tp is None else tp.all_reduce(x)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split over the ranks (padded to a multiple of size): each
    rank looks up the ids it holds, zeros for the others, and one all-reduce sums them."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        local = input_ids - self.start
        held = (local >= 0) & (local < self.per_rank)
        x = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        return self.tp.all_reduce(x * held.unsqueeze(-1).to(x.dtype))


def vocab_embedding(vocab_size: int, dim: int) -> nn.Embedding | VocabParallelEmbedding:
    """nn.Embedding, or its vocab-parallel form inside tensor_parallel()."""
    tp = current()
    return (
        nn.Embedding(vocab_size, dim) if tp is None else VocabParallelEmbedding(vocab_size, dim, tp)
    )


def vocab_per_rank(vocab_size: int) -> int:
    """Rows of the LM head on this rank (the whole vocabulary when not sharded)."""
    tp = current()
    return vocab_size if tp is None else -(-vocab_size // tp.size)


def gather_logits(tp: TensorParallel | None, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, vocab / size] per rank -> [N, vocab] on every rank (the padding dropped)."""
    if tp is None:
        return logits
    return tp.gather_last(logits)[..., :vocab_size]
