"""The inline PTX that turns Q4_K / Q5_K / Q6_K quants into bfloat16 on CUDA (gguf_blocks' LOWP),
run on the CPU by an emulator of its five instructions as the PTX ISA defines them (mov, shr /
shl, prmt, lop3, sub.rn.bf16x2), against the formats' own bit layouts (ggml's
dequantize_row_q4_K / q6_K): every byte value, in each lane of a packed register. The GPU
tests run the same code on the device (test_gguf_gemm's bfloat16 products).

The lanes follow Triton's lowering of inline_asm_elementwise with pack=4 (read in its
ElementwiseInlineAsmOpConversion, lib/Conversion/TritonGPUToLLVM/ElementwiseOpToLLVM.cpp):
element k of a group of four uint8 operands is inserted at index k of a 4 x i8 vector, so it is
byte k of the 32-bit register (little-endian); a bfloat16 result is a struct of two 2 x bf16
vectors, element 0 in $0's low half, 1 in its high half, 2 and 3 in $1; a 32-bit operand takes
one register per element ($4 to $7)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mmserve.kernels import gguf_blocks


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _bf16_bits(value: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    assert bits & 0xFFFF == 0, f"{value} is not a bfloat16"
    return bits >> 16


def _prmt(a: int, b: int, selector: int) -> int:
    source = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(source[(selector >> 4 * i) & 7] << 8 * i for i in range(4))


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for i in range(32):
        index = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        out |= ((lut >> index) & 1) << i
    return out


def _run(asm: str, in2: int, in3: int, in4: int = 0) -> list[float]:
    """The four bfloat16 outputs ($0's low and high half, then $1's) of asm on $2, $3 and $4."""
    regs = {"$2": in2, "$3": in3, "$4": in4}

    def value(token: str) -> int:
        return regs[token] if token in regs else int(token, 0)

    for instruction in asm.strip("{} ").split(";"):
        instruction = instruction.strip()
        if not instruction or instruction.startswith(".reg"):
            continue
        op, rest = instruction.split(None, 1)
        dst, *args = (t.strip() for t in rest.split(","))
        v = [value(a) for a in args]
        if op == "mov.b32":
            regs[dst] = v[0]
        elif op == "shr.b32":
            regs[dst] = v[0] >> v[1]
        elif op == "shl.b32":
            regs[dst] = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            regs[dst] = _prmt(*v)
        elif op == "lop3.b32":
            regs[dst] = _lop3(*v)
        elif op == "sub.rn.bf16x2":
            low = _bf16_bits(_bf16(v[0]) - _bf16(v[1]))
            high = _bf16_bits(_bf16(v[0] >> 16) - _bf16(v[1] >> 16))
            regs[dst] = low | high << 16
        else:
            raise AssertionError(f"the emulator lacks {op}")
    return [_bf16(regs["$0"]), _bf16(regs["$0"] >> 16), _bf16(regs["$1"]), _bf16(regs["$1"] >> 16)]


def _lanes() -> list[tuple[list[int], list[int]]]:
    """Every byte value in every lane of the four, paired with other bytes."""
    rng = np.random.default_rng(0)
    out = []
    for value in range(256):
        for lane in range(4):
            low, high = rng.integers(0, 256, 4).tolist(), rng.integers(0, 256, 4).tolist()
            low[lane], high[(lane + 1) % 4] = value, value
            out.append((low, high))
    return out


def _word(lanes: list[int]) -> int:
    return sum(b << 8 * i for i, b in enumerate(lanes))


@pytest.mark.parametrize("high", [False, True])
def test_q4k_nibbles(high: bool) -> None:
    asm = (gguf_blocks._Q4K_HIGH if high else gguf_blocks._Q4K_LOW).value
    for ql, _ in _lanes():
        assert _run(asm, _word(ql), _word(ql)) == [(b >> 4 if high else b & 15) for b in ql]


@pytest.mark.parametrize("quarter", range(4))
def test_q6k_quarter(quarter: int) -> None:
    """Quarter p of a Q6_K super-block: the nibble of ql at 4 (p // 2), the two bits of qh at 2 p,
    minus 32 (ggml: q1 = (ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32, and so on)."""
    asm = getattr(gguf_blocks, f"_Q6K_{quarter}").value
    for ql, qh in _lanes():
        expected = [
            (((lo >> 4 * (quarter // 2)) & 15) | (((hi >> 2 * quarter) & 3) << 4)) - 32
            for lo, hi in zip(ql, qh, strict=True)
        ]
        assert _run(asm, _word(ql), _word(qh)) == expected


@pytest.mark.parametrize("chunk", range(4))
@pytest.mark.parametrize("high", [False, True])
def test_q5k_quants(high: bool, chunk: int) -> None:
    """Q5_K: a nibble of qs with a bit of qh as the fifth (ggml: (ql[l] & 0xF) + (qh[l] & u1 ?
    16 : 0), u1 = 1 << 2 c for chunk c's low nibbles, u2 = u1 << 1 for its high ones); the
    PTX takes 2 c in $4."""
    asm = (gguf_blocks._Q5K_HIGH if high else gguf_blocks._Q5K_LOW).value
    for ql, qh in _lanes():
        expected = [
            ((lo >> 4 if high else lo & 15) + (16 if hi >> (2 * chunk + int(high)) & 1 else 0))
            for lo, hi in zip(ql, qh, strict=True)
        ]
        assert _run(asm, _word(ql), _word(qh), 2 * chunk) == expected
