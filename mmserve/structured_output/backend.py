"""The grammar-engine interface every backend implements, and the token bitmask helpers.

A token bitmask is an int32 tensor of shape [batch, ceil(vocab_size / 32)]: bit j of word i
of a row allows token 32 * i + j. `vocab_size` is the model's logits width, which may exceed
the tokenizer's vocabulary (padded lm_head); tokens past the tokenizer are never allowed.
"""

from __future__ import annotations

import abc
import functools
import importlib.util
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Self

import torch

from .params import StructuredOutputParams
from .schema_tree import RelaxedKeyword

if TYPE_CHECKING:  # the sampler imports this module; it needs no transformers
    from transformers import PreTrainedTokenizerFast


class GrammarMatcher(abc.ABC):
    """The state of one request's output against a compiled grammar.

    Not thread-safe: one matcher belongs to one request and is driven by one thread.
    """

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. Returns False (state unchanged) if the grammar
        does not allow it. A stop token is accepted only where the grammar may end, and
        terminates the matcher."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (a contiguous CPU int32 tensor of
        shape [B, ceil(vocab_size / 32)]). Where the grammar is complete only stop tokens
        are set (also once terminated)."""

    @classmethod
    def fill_bitmasks(
        cls, matchers: Sequence[Self], bitmask: torch.Tensor, rows: Sequence[int], threads: int
    ) -> None:
        """Fill bitmask[rows[i]] for each matchers[i], all of this class, on up to `threads`
        threads; rows are distinct. The same result as `fill_bitmask` on each; the default
        is that, one at a time. Call it through the module's `fill_bitmasks`."""
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)

    @classmethod
    def accept_tokens(cls, matchers: Sequence[Self], tokens: Sequence[int]) -> list[bool]:
        """accept_token(tokens[i]) on each matchers[i], all of this class; the default is
        one at a time. Call it through the module's `accept_tokens`."""
        return [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding, rejected drafts).
        Every backend supports at least MAX_ROLLBACK_TOKENS; past what a backend keeps, or
        past the first token, it raises ValueError."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token has been accepted."""

    def jump_forward(self) -> str:
        """The text every valid continuation starts with from here ("" when the grammar
        leaves a choice, or the backend cannot tell): speculative decoding proposes it."""
        return ""

    @abc.abstractmethod
    def reset(self) -> None:
        """Back to the start state (a preempted request that will recompute)."""


class CompiledGrammar(abc.ABC):
    """An immutable compiled constraint, shared (cached) by every request that uses it."""

    # The schema keywords compiled around (StructuredOutputParams.relaxed), in the order
    # found; empty unless relaxed.
    relaxed: tuple[RelaxedKeyword, ...] = ()

    @abc.abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start state. Thread-safe."""


class StructuredOutputBackend(abc.ABC):
    """One grammar engine bound to one model's tokenizer and logits width.

    Constructed once per model (building the engine's vocabulary takes ~0.5 s for a 50k
    vocabulary); `compile` may be called from several threads at once.
    """

    name: str  # registry name

    @abc.abstractmethod
    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        """tokenizer: the model's; vocab_size: the model's logits width (may differ from
        the tokenizer's size); eos_token_ids: the tokens that end generation, allowed only
        where the grammar may end."""

    @abc.abstractmethod
    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """Compile a validated constraint. Raises InvalidArgument pointing at the offending
        part (SchemaError with a JSON pointer for schemas) if it is malformed, too large,
        or uses anything this backend would not enforce."""

    def close(self) -> None:
        """Releases what the backend holds beyond memory (worker processes)."""


# How far a matcher can be rolled back; enough for speculative decoding's drafts.
MAX_ROLLBACK_TOKENS = 64


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A CPU bitmask with every token allowed, [batch_size, ceil(vocab_size / 32)] int32.

    Rows of unconstrained requests stay all-ones; `apply_bitmask` skips them anyway.
    pin_memory (CUDA only): page-locked, so the copy to the GPU is asynchronous.
    """
    shape = (batch_size, bitmask_width(vocab_size))
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin_memory)


# threads for one step's bitmask fill (a switch for A/B runs); None: default_fill_threads' rule
FILL_THREADS: int | None = None


def default_fill_threads() -> int:
    """Threads for one step's bitmask fill: FILL_THREADS, else half the CPUs this process may
    use, at most 8 (the rest are for the scheduler, detokenising and the server)."""
    if FILL_THREADS:
        return FILL_THREADS
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(8, (cpus or 1) // 2) or 1


def fill_bitmasks(
    matchers: Sequence[GrammarMatcher],
    bitmask: torch.Tensor,
    rows: Sequence[int],
    threads: int | None = None,
) -> None:
    """Fill bitmask[rows[i]] for each matchers[i]: the same result as `fill_bitmask` on each.

    Matchers of one backend are filled by one call of their class's `fill_bitmasks` (xgrammar:
    in parallel, on `threads` threads, default `default_fill_threads()`); a batch mixing
    backends makes one call per backend. rows must be distinct rows of `bitmask`.
    """
    if len(matchers) != len(rows):
        raise ValueError(f"{len(matchers)} matchers for {len(rows)} rows")
    if len(set(rows)) != len(rows) or not all(0 <= r < bitmask.shape[0] for r in rows):
        raise ValueError(f"rows must be distinct rows of a bitmask of {bitmask.shape[0]}")
    groups: dict[type[GrammarMatcher], tuple[list[GrammarMatcher], list[int]]] = {}
    for matcher, row in zip(matchers, rows):
        group = groups.setdefault(type(matcher), ([], []))
        group[0].append(matcher)
        group[1].append(row)
    for cls, (group_matchers, group_rows) in groups.items():
        cls.fill_bitmasks(group_matchers, bitmask, group_rows, threads or default_fill_threads())


def accept_tokens(matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
    """One step's sampled tokens into their matchers (one call per backend: xgrammar's is
    a single native call for the batch); whether each was accepted, in order."""
    if len(matchers) != len(tokens):
        raise ValueError(f"{len(matchers)} matchers for {len(tokens)} tokens")
    groups: dict[type[GrammarMatcher], list[int]] = {}
    for i, matcher in enumerate(matchers):
        groups.setdefault(type(matcher), []).append(i)
    accepted = [False] * len(matchers)
    for cls, where in groups.items():
        results = cls.accept_tokens([matchers[i] for i in where], [tokens[i] for i in where])
        for i, ok in zip(where, results, strict=True):
            accepted[i] = ok
    return accepted


def allow_tokens(words: torch.Tensor, token_ids: Iterable[int]) -> None:
    """Also allow `token_ids` in one bitmask row ([W] int32, CPU)."""
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        value = (int(words[word]) & 0xFFFFFFFF) | (1 << bit)
        words[word] = value - (1 << 32) if value >= 1 << 31 else value  # as int32


def _bit_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool (True = allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _bit_positions(bitmask.device)) & 1  # [R, W, 32]
    return bits.bool().flatten(1)[:, :vocab_size]


# (logits [B, V], bitmask [B, W] on logits' device, vocab_size=V, indices=rows) -> None
BitmaskKernel = Callable[..., None]


def apply_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: Sequence[int],
    kernel: BitmaskKernel | None = None,
) -> None:
    """Set disallowed tokens of logits[rows] to -inf, in place.

    logits: [B, V] float on any device; bitmask: [B, W] int32 with W * 32 >= V, row i
    belonging to logits row i (usually on the CPU, pinned when logits are on a GPU: it is
    copied to logits' device without waiting); rows: the constrained rows (the others are
    left untouched). kernel: one to use (the same call as _device_kernel's) instead of the
    device's own (xgrammar's where installed, else the torch code).
    """
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("expected logits [B, V] and an int32 bitmask [B, W]")
    vocab_size = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"bitmask covers {bitmask.shape[1] * 32} tokens, logits have {vocab_size}")
    mask = bitmask.to(logits.device, non_blocking=True)  # async from pinned memory
    kernel = kernel or _device_kernel(logits.device.type)
    if kernel is not None and logits.stride(1) == 1 and mask.stride(1) == 1:
        kernel(logits, mask, vocab_size=vocab_size, indices=list(rows))
        return
    _apply_with_torch(logits, mask, vocab_size, rows)


def _apply_with_torch(logits: torch.Tensor, mask: torch.Tensor, vocab_size: int, rows: Sequence[int]) -> None:
    """apply_bitmask in torch operations (mask on logits' device): the reference."""
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    allowed = unpack_bitmask(mask.index_select(0, index), vocab_size)  # [R, V]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


@functools.cache
def _device_kernel(device_type: str) -> BitmaskKernel | None:
    """xgrammar's kernel for logits on this device where installed, or None: the torch code
    above, the reference the kernels are tested against. CUDA: its Triton kernel (with
    triton; one launch, no [R, V] temporaries). CPU: its C++ loop for float32 / bfloat16 /
    float16 (the runner passes the C library's instead for float32: mmserve.kernels.cpu_layers).
    64 rows of Llama 3's 128,256 logits in a JSON grammar's states, 2 cores: torch 26 ms,
    xgrammar 12.5, the library 0.9."""
    have = {name: importlib.util.find_spec(name) is not None for name in ("xgrammar", "triton")}
    if not have["xgrammar"] or device_type not in ("cuda", "cpu"):
        return None
    if device_type == "cuda" and not have["triton"]:
        return None
    from xgrammar import apply_token_bitmask_inplace

    kernel = functools.partial(
        apply_token_bitmask_inplace, backend="triton" if device_type == "cuda" else "cpu"
    )
    if device_type == "cuda":
        return kernel

    def on_cpu(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, indices: list[int]) -> None:
        if logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
            kernel(logits, bitmask, vocab_size=vocab_size, indices=indices)
        else:
            _apply_with_torch(logits, bitmask, vocab_size, indices)

    return on_cpu
