"""Checks shared by the kernel launchers: every bad input is a ValueError naming the argument."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels run on device: CUDA, or any device under the interpreter (tests)."""
    return device.type == "cuda" or bool(triton.knobs.runtime.interpret)


def check_same_device(**tensors: torch.Tensor) -> None:
    """All tensors on one device, and that device can run Triton (CUDA, or the interpreter)."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")
    device = next(iter(devices.values()))
    if not triton_runs_on(device):
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); on CPU use the torch reference "
            "path, or set TRITON_INTERPRET=1 before importing triton (tests only)"
        )


@functools.cache
def num_sms(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (what launch grids are sized against)."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


INTERPRETER_SMS = 132  # the SMs a grid is sized against under the interpreter: an H200's


def grid_sms(device: torch.device) -> int:
    """num_sms on CUDA; under the interpreter an H200's, so that tests size and split grids as
    the GPU does."""
    return num_sms(device) if device.type == "cuda" else INTERPRETER_SMS


def check_at_least(name: str, value: int | None, low: int) -> None:
    """An optional integer argument, when given, is at least `low`."""
    if value is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32/float16/bfloat16, got {t.dtype}")


def check_cache_dtype(name: str, cache: torch.Tensor) -> None:
    """A KV cache holds float32/float16/bfloat16, or FP8 (e4m3) with scales."""
    if cache.dtype not in (*FLOAT_DTYPES, torch.float8_e4m3fn):
        raise ValueError(
            f"{name} must be float32/float16/bfloat16 or float8_e4m3fn, got {cache.dtype}"
        )


@triton.jit
def to_cache(x, inv_scale, dtype: tl.constexpr, FP8: tl.constexpr):
    """x as a KV cache of dtype stores it: an FP8 cache holds x / scale, saturated."""
    if FP8:
        return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(dtype)
    return x.to(dtype)


# Programmatic dependent launch (Hopper and later): a kernel launched with it (launch_pdl) may
# start while the kernel before it on the stream still runs, once each of that kernel's programs
# has passed pdl_wait (or ended). pdl_wait blocks until the kernel before has ended and its writes
# are visible, then lets the next kernel start. So each Triton kernel of a decode step (norms,
# rotary, attention, the activation, the products) is launched and ramps up while the one before
# finishes: the launch gap between kernels, a few microseconds each and about ten a layer,
# overlaps. Each kernel waits first, before it reads or writes anything. (A product reading its
# first weights before the wait, w4a16's, was slower: its loop lost its shape.) Kernels not
# launched with it (torch's, cuBLAS) start after the kernel before them has ended, as always. On
# an H100 (session 27, batch-1 decode at the 8B shape, off -> on): FP8 4.18 -> 3.93 ms/token,
# GGUF Q4_K_M 3.66 -> 3.52. The GPU tests pass under it (pytest --pdl), and a chain of these
# kernels replayed from a CUDA graph equals its run without it, to the bit.
PDL = True
_PDL_WAIT = tl.constexpr("griddepcontrol.wait; // $0")
_PDL_LAUNCH = tl.constexpr("griddepcontrol.launch_dependents; // $0")


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel that calls pdl_wait: PDL (its constexpr) and Triton's
    launch_pdl, on where PDL is set and device is a CUDA device of compute capability 9.0 or
    later (never under the interpreter, which has no grid dependencies)."""
    on = PDL and device.type == "cuda" and not triton.knobs.runtime.interpret and _pdl_capable(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Under PDL (pdl_launch): wait for the kernel before this one on the stream to end (its
    writes then visible), then let the next kernel start."""
    if PDL:
        tl.inline_asm_elementwise(_PDL_WAIT, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise(_PDL_LAUNCH, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


# An L2 prefetch of a line (prefetch.global.L2, sm_90 and earlier alike): it occupies no register
# and nothing waits for it. A product issues it for its first weights before pdl_wait: they do not
# depend on the kernel before, so under PDL their reads overlap that kernel's end, and the loop,
# unchanged, finds them in L2
_PREFETCH_L2 = tl.constexpr("prefetch.global.L2 [$1]; mov.u32 $0, 0;")


def prefetch_count(lines: int) -> int:
    """The prefetch size a kernel takes (an arange's length): lines rounded down to a power of
    two, or 0."""
    return 1 << (lines.bit_length() - 1) if lines > 0 else 0


@triton.jit
def prefetch_l2(base, offsets, size, ASM: tl.constexpr):
    """Asks L2 for the lines at base + offsets (elements; each must lie inside the tensor's
    size elements from base: clamp, do not mask) and returns 0.0. The interpreter (ASM off, no
    prefetch) checks the offsets instead and returns NaN if one lies outside, for the caller to
    add to its output, so that a test sees an address past the tensor (the interpreter's
    device_assert is off, and its loads past a tensor read whatever lies there)."""
    if ASM:
        tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [base + offsets], dtype=tl.int32, is_pure=False, pack=1)
        return 0.0
    else:
        outside = tl.sum(((offsets < 0) | (offsets >= size)).to(tl.int32))
        return tl.where(outside > 0, float("nan"), 0.0)


# The int8-activation products (gguf_gemm.DP4A, wna16.DP4A): dp4a multiplies four unsigned weight
# bytes by four signed activation bytes and adds the four products in one instruction; the
# interpreter (CI) runs the same integer arithmetic byte by byte
_DP4A = tl.constexpr("dp4a.u32.s32 $0, $1, $2, $3;")


@triton.jit
def dp4a(a, b, c, ASM: tl.constexpr):
    """c + the sum of the products of a's four unsigned bytes with b's four signed bytes
    (int32 words; byte k with byte k)."""
    if ASM:
        return tl.inline_asm_elementwise(_DP4A, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        for k in tl.static_range(4):
            c += ((a >> (8 * k)) & 0xFF) * ((b << (24 - 8 * k)) >> 24)
        return c


@triton.jit
def q8_values(x, amax):
    """float32 x as int8 values (int32) against its group's max |x| (broadcast like x), rounded as
    q8_round_trip rounds: x 127 / max |x|, half away from zero (a group of zeros stays 0)."""
    v = x * (127.0 / tl.where(amax > 0, amax, 1.0))
    return tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)


@triton.jit
def store_product(
    out_ptr, acc, offs, mask, split, splits, slab, final_ptr, counter_ptr,
    SPLIT: tl.constexpr, SERIAL: tl.constexpr,
):  # fmt: skip
    """A program's float32 result acc at offs of a contiguous [rows, n] product (mask: those that
    exist): into out_ptr in its dtype; SPLIT, as K slice `split`'s partial, slab (rows n)
    elements after the previous slice's ([splits, rows, n] float32, which sum_splits adds).
    SERIAL: then the last of the tile's `splits` programs to get here (counter_ptr: the tile's
    int32 counter, zero before and after the product, split_counters) adds the partials up in
    order, as sum_splits does, and stores them at final_ptr: no second kernel."""
    if SPLIT:
        tl.store(out_ptr + split.to(tl.int64) * slab + offs, acc, mask=mask)
        if SERIAL:  # noqa: SIM102 (a constexpr: the atomic only where it is compiled in)
            if last_of_splits(counter_ptr, splits):
                total = sum_partials(out_ptr, offs, mask, slab, splits)
                tl.store(final_ptr + offs, total.to(final_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def last_of_splits(counter_ptr, splits):
    """After a program stored its K slice's partial: whether it is the last of its tile's
    `splits` programs to get here (then the others' partials are visible to it, and the tile's
    counter is set back to zero for the next product)."""
    tl.debug_barrier()  # every thread's partial stored before the tile's count goes up
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == splits - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def sum_partials(part_ptr, offs, mask, slab, splits):
    """The partials [splits, ...] at offs summed in order (as sum_splits adds them), read past
    the SM's L1 (other programs wrote them)."""
    total = tl.load(part_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
    for s in range(1, splits):
        total += tl.load(part_ptr + s * slab + offs, mask=mask, other=0, cache_modifier=".cg")
    return total


@triton.jit
def store_tile(out_ptr, acc, offs, mask, slab, final_ptr, counters_ptr, SPLIT: tl.constexpr, SERIAL: tl.constexpr):
    """store_product for a grid of (tiles, K slices): program_id(0) the tile (its counter),
    program_id(1) the slice."""
    store_product(
        out_ptr, acc, offs, mask, tl.program_id(1), tl.num_programs(1), slab, final_ptr,
        counters_ptr + tl.program_id(0), SPLIT, SERIAL,
    )  # fmt: skip


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {list(expected)}, got {list(t.shape)}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {layout} ({ndim}-D), got shape {list(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got {t.stride()}")


def check_index_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")


def scaled_operand_sizes(xq: torch.Tensor, wq: torch.Tensor) -> tuple[int, int, int]:
    """(M, K, N) of a product xq [M, K] @ wq [N, K]^T; ValueError unless they share K."""
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(
            f"xq [M, K] and wq [N, K] must share K, got {list(xq.shape)} and {list(wq.shape)}"
        )
    return xq.shape[0], xq.shape[1], wq.shape[0]


def check_scales(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor
) -> None:
    """A scaled product's per-row and per-channel scales (x_scale [M, 1], w_scale [1, N]) fit
    its operands, whose rows are contiguous, all on one device."""
    check_shape("x_scale", x_scale, (xq.shape[0], 1))
    check_shape("w_scale", w_scale, (1, wq.shape[0]))
    check_last_dim_contiguous("xq", xq)
    check_last_dim_contiguous("wq", wq)
    check_same_device(xq=xq, x_scale=x_scale, wq=wq, w_scale=w_scale)


def matmul_in_column_chunks(
    x: torch.Tensor, n: int, chunk_elements: int, weight_t: Callable[[slice], torch.Tensor]
) -> torch.Tensor:
    """x [M, K] @ W^T [K, N] with W^T made chunk_elements at a time: weight_t(columns) gives the
    [K, columns] slice of W^T (a weight dequantised for many rows: no float copy of all of it)."""
    k = x.shape[1]
    step = max(1, chunk_elements // max(k, 1))
    if step >= 256:  # whole 128-column tiles per chunk, as cuBLAS's kernels like them
        step -= step % 128
    outs = [x @ weight_t(slice(start, start + step)) for start in range(0, max(n, 1), step)]  # once for N = 0
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


MAX_SPLITS = 32  # slices of K at most (a product's partial sums: splits x its output)


def k_splits(tiles: int, steps: int, sms: int, programs_per_sm: int) -> tuple[int, int]:
    """(splits, steps per split) for a product of `tiles` output tiles whose programs each walk
    `steps` K steps serially: K split into slices of whole steps until about programs_per_sm
    programs run on every SM (a program's serial K loop is latency-bound: at one row the H200
    read a 4096 x 4096 w4a16 weight at a tenth of its bandwidth without a split, session 11),
    never more than MAX_SPLITS or steps. programs_per_sm 0: no split."""
    return split_steps(steps, min(MAX_SPLITS, triton.cdiv(programs_per_sm * sms, max(tiles, 1))))


def split_steps(steps: int, wanted: int) -> tuple[int, int]:
    """(splits, steps per split): `steps` K steps in at most `wanted` slices of whole steps
    (at least one slice, none empty)."""
    per_split = triton.cdiv(steps, max(1, min(wanted, steps)))
    return triton.cdiv(steps, per_split), per_split


@triton.jit
def _sum_splits_kernel(out_ptr, part_ptr, size, splits, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[i] = sum over s of part[s, i], s in order (the same result every run)."""
    pdl_wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * size + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(out: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """out (contiguous) = part [splits, *out.shape] (float32) summed over its first dimension,
    in order, in float32, cast to out's dtype."""
    size, block = out.numel(), 1024
    _sum_splits_kernel[(triton.cdiv(size, block),)](out, part, size, part.shape[0], BLOCK=block, **pdl_launch(out.device))
    return out


# A product whose K is split writes each slice's partial sums. SERIAL_SPLITS: the last program of
# each output tile to finish (an int32 counter a tile, split_counters) adds them up and stores the
# output (store_product; fp8_gemm's rows kernel scales them too), in place of a second kernel
# (sum_splits, fp8_gemm._scale: a launch of a few microseconds at every split product of a decode
# step, four a layer at one row of GGUF and w4a16, two of FP8). The result is the second kernel's
# to the bit. On: batch-1 decode on an H100 (session 26) FP8 4.13 -> 4.06 ms/token, w4a16-g128
# 3.21 -> 3.15, GGUF Q4_K_M 3.81 -> 3.63
SERIAL_SPLITS = True
MAX_COUNTERS = 4096  # a split product's programs at most (k_splits splits grids of < 4 x SMs)
_counters: dict[tuple[torch.device, object], torch.Tensor] = {}


def split_target(out: torch.Tensor, splits: int, programs: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(where a product's programs write, counters): out itself for one slice of K; else float32
    partials [splits, *out.shape] and, SERIAL_SPLITS and at most MAX_COUNTERS programs a slice,
    their tiles' counters (None: finish_splits sums them by sum_splits)."""
    if splits <= 1:
        return out, None
    target = torch.empty(splits, *out.shape, dtype=torch.float32, device=out.device)
    return target, serial_counters(out.device, programs)


def serial_counters(device: torch.device, programs: int) -> torch.Tensor | None:
    """split_counters when the last program of each tile is to sum a product's slices
    (SERIAL_SPLITS, at most MAX_COUNTERS programs a slice), else None."""
    return split_counters(device) if SERIAL_SPLITS and programs <= MAX_COUNTERS else None


def split_counters(device: torch.device) -> torch.Tensor:
    """MAX_COUNTERS int32 zeros for the current stream of device (kernels on one stream run one at
    a time; each leaves its counters zero). A CUDA graph captures the buffer of its capture
    stream, which its replays then use in the same order."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    key = (device, stream)  # (a pooled stream comes back to other users: their kernels queue in order too)
    if key not in _counters:
        _counters[key] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _counters[key]


def store_args(out: torch.Tensor, counters: torch.Tensor | None) -> dict[str, object]:
    """The product kernels' final_ptr, counters_ptr and SERIAL for split_target's counters."""
    return {"final_ptr": out, "counters_ptr": out if counters is None else counters, "SERIAL": counters is not None}


def finish_splits(out: torch.Tensor, target: torch.Tensor, counters: torch.Tensor | None) -> torch.Tensor:
    """out once the product kernel wrote target (split_target): its partials summed by sum_splits
    unless the kernel did it (counters) or there were none."""
    if target is not out and counters is None:
        sum_splits(out, target)
    return out


def q8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """float32 x [M, K] (K a multiple of 32) as the int8-activation products round it (ggml's
    q8_1: gguf_blocks.q8_step, wna16's DP4A): by 32, q = x 127 / max |x| rounded half away from
    zero, times max |x| / 127."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    amax = groups.abs().amax(dim=2, keepdim=True)
    v = groups * (127.0 / torch.where(amax > 0, amax, 1.0))
    q = torch.where(v >= 0, v + 0.5, v - 0.5).trunc()
    return (q * (amax / 127.0)).reshape(x.shape)


def int8_activations_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 [M, N]: an int8-activation product's arithmetic on a weight w [N, K]: x rounded
    by q8_round_trip times w. A weight's part without its quants (a zero point's, a min's: constant
    over each group of 32 along K) meets the rounded activations too, through their group's
    sum (ggml's q8_1 s = d sum q, as its vec_dot_q4_1_q8_1 and vec_dot_q4_K_q8_1 use it): against
    x's own sum, measured on SmolLM2's Q4_1 (BENCHMARKS.md, session 39), the next-token
    distribution moved 4x further from float32's, the quants' part alone not being centred."""
    return q8_round_trip(x) @ w.float().t()
