"""Compiles the GGUF Triton kernels (and w4a16's, FP8's rows kernel and paged attention's) for sm_90 (the H100 / H200) on
any machine, without a GPU: `python -m tests.kernels.sm90_compile` exits 0 when every variant compiles to a cubin.
The interpreter that runs the kernels on the CPU accepts code that Triton's compiler
refuses (session 20: a variable that was both a loop bound and a dot's result), so
tests/kernels/test_sm90_compile.py runs this in a process without TRITON_INTERPRET.

By default each kernel compiles over a cover of its constexpr choices: one launch with the
first value of every choice, then each other value of each choice with the rest at their first
(about 120 compiles; on a 2 GHz 2-core machine the whole product, 254, took 10.8 minutes of
one core with an empty Triton cache, session 28). `--all` compiles the whole product."""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mmserve.kernels import fp8_gemm, gguf_blocks, gguf_gemm, host_gate, paged_attention, wna16
from mmserve.kernels._common import prefetch_count
from mmserve.kernels.gguf_blocks import FORMATS, STEP_PARTS

SM90 = GPUTarget("cuda", 90, 32)
ROWS = {"out_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*u8", "rows": "i32", "n": "i32",
        "num_blocks": "i32", "steps_per_split": "i32", "num_steps": "i32", "row_bytes": "i32",
        "stride_x": "i32", "final_ptr": "*bf16", "counters_ptr": "*i32"}  # fmt: skip
GEMV = {"out_ptr": "*fp32", "x_ptr": "*bf16", "w_ptr": "*u8", "n": "i32", "num_blocks": "i32",
        "steps_per_split": "i32", "num_steps": "i32", "row_bytes": "i32", "final_ptr": "*bf16",
        "counters_ptr": "*i32"}  # fmt: skip
WNA16 = {"out_ptr": "*fp32", "x_ptr": "*bf16", "qweight_ptr": "*i32", "scales_ptr": "*bf16",
         "zeros_ptr": "*bf16", "rows": "i32", "n": "i32", "k": "i32", "group_size": "i32",
         "k_per_split": "i32", "stride_x": "i32", "stride_q": "i32", "stride_s": "i32", "final_ptr": "*bf16",
         "counters_ptr": "*i32"}  # fmt: skip
DP4A = {"out_ptr": "*fp32", "x_ptr": "*bf16", "d_ptr": "*fp32", "sum_ptr": "*fp32", "w_ptr": "*u8", "n": "i32",
        "steps_per_split": "i32", "num_steps": "i32", "row_bytes": "i32", "stride_x": "i32", "final_ptr": "*bf16", "counters_ptr": "*i32"}  # fmt: skip
Q6K_DP4A = {k: "*i32" if k == "x_ptr" else t for k, t in DP4A.items() if k not in ("sum_ptr", "stride_x")}
WNA16_DP4A = {"out_ptr": "*fp32", "x_ptr": "*bf16", "qweight_ptr": "*i32", "scales_ptr": "*bf16",
              "zeros_ptr": "*bf16", "n": "i32", "k": "i32", "group_size": "i32", "k_per_split": "i32",
              "stride_q": "i32", "stride_s": "i32", "final_ptr": "*bf16", "counters_ptr": "*i32"}  # fmt: skip
# (SPLIT, SERIAL): one slice of K; slices summed by sum_splits; slices summed by the last program
# (the serving default first: a cover varies one choice at a time from the first values)
ENDS = ({"SPLIT": True, "SERIAL": True}, {"SPLIT": False, "SERIAL": False}, {"SPLIT": True, "SERIAL": False})
ALL = False  # every combination of the constexpr choices (--all), not a cover of them
# the formats whose rows and GEMV kernels compile with every ENDS; the others with the serving
# default's only (the ends are the same code whatever the format's blocks: a cold compile of all
# of them took 80 s of the CI suite's time)
ENDS_FORMATS = ("Q4_0", "Q4_K", "Q6_K")


def cases(*choices: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """The combinations of choices to compile: all of them with ALL, else a cover (the first
    value of each; then each other value of one choice, the rest at their first)."""
    if ALL:
        return list(itertools.product(*choices))
    first = tuple(c[0] for c in choices)
    return [first] + [first[:i] + (v,) + first[i + 1 :] for i, c in enumerate(choices) for v in c[1:]]
FP8 = {"out_ptr": "*bf16", "part_ptr": "*fp32", "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "wq_ptr": "*fp8e4nv",
       "ws_ptr": "*fp32", "counters_ptr": "*i32", "rows": "i32", "n": "i32", "k": "i32", "k_per_split": "i32",
       "stride_x": "i32", "stride_w": "i32", "stride_out": "i32"}  # fmt: skip
WNA16_DP4A_ROWS = {"out_ptr": "*fp32", "words_ptr": "*i32", "d_ptr": "*fp32", "sum_ptr": "*fp32",
                   "qweight_ptr": "*i32", "scales_ptr": "*bf16", "zeros_ptr": "*bf16", "n": "i32", "k": "i32",
                   "group_size": "i32", "k_per_split": "i32", "stride_q": "i32", "stride_s": "i32",
                   "num_steps": "i32", "final_ptr": "*bf16", "counters_ptr": "*i32"}  # fmt: skip
DEQUANT = {"out_ptr": "*bf16", "w_ptr": "*u8", "n": "i32", "k": "i32", "num_blocks": "i32",
           "row_bytes": "i32"}  # fmt: skip


def compile_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                 aligned: tuple[str, ...] = (), num_warps: int = 4) -> Any:  # fmt: skip
    """fn compiled for sm_90 (the compiled kernel: .asm["cubin"], ["ptx"], ...). aligned: the
    integer arguments a launch would pass divisible by 16 (Triton specialises on it; pointers
    are taken as 16-byte aligned, as torch allocates them), so that the code is the code a
    launch compiles."""
    names = fn.arg_names
    if "PDL" in names:  # the programmatic dependent launch's wait compiled in (pdl_launch)
        constexprs = {"PDL": True, **constexprs}
    divisible = [k for k, t in signature.items() if t.startswith("*")] + list(aligned)
    source = ASTSource(
        fn=fn,
        signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible},
    )
    options = {"num_warps": num_warps, "launch_pdl": bool(constexprs.get("PDL"))}
    kernel = triton.compile(source, target=SM90, options=options)
    assert "cubin" in kernel.asm
    return kernel


def main() -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "compile with the interpreter off"
    for qtype, fmt in FORMATS.items():
        args = {**fmt.kernel_args(), "PARTS": STEP_PARTS[fmt.type_id]}
        ends_cover = ENDS if ALL or qtype in ENDS_FORMATS else ENDS[:1]
        forms = (True, False) if qtype in ("Q4_K", "Q5_K") else (False,)
        lowp = ((False, False), (True, True), (True, False)) if qtype in gguf_blocks.LOWP_TYPES else ((False, False),)
        layouts = (False, True) if qtype == "Q6_K" else (False,)  # PLANES: Q6_K in planes (gguf_planes)
        for factored, unroll, ends, (low, asm), planes in cases(forms, (1, 2), ends_cover, lowp, layouts):
            compile_sm90(gguf_gemm._gguf_gemm_rows_kernel, ROWS, {
                **args, "IEEE": False, "BLOCK_M": 8 if low else 16, "BLOCK_N": 64, **ends,
                "FACTORED": factored and not low, "UNROLL": unroll, "LOWP": low, "ASM": asm,
                "WORDS": low and qtype != "Q6_K" and ends["SPLIT"], "PLANES": planes})  # fmt: skip
        for ends, planes in cases(ends_cover, layouts):
            compile_sm90(gguf_gemm._gguf_gemv_kernel, GEMV, {**args, "BLOCK_N": 64, **ends, "PLANES": planes})
        for ends, planes, rows in cases(ENDS, layouts, (1, 3)) if qtype == "Q6_K" else ():
            compile_sm90(gguf_gemm._gguf_q6k_dp4a_kernel, Q6K_DP4A, {
                "BLOCK_N": 64, "ROWS": rows, **ends, "ASM": True, "PLANES": planes})  # fmt: skip
        dp4a_forms = ((False, 1), (True, 1), (False, 3), (True, 3))  # (PREQUANT, ROWS)
        for ends, (pre, rows) in cases(ENDS, dp4a_forms) if qtype in ("Q4_K", "Q5_K") else ():
            # (one row at the type's default tile, DP4A_ONE_ROW_TILE)
            block_n, warps = gguf_gemm.DP4A_ONE_ROW_TILE.get(qtype, (64, 4)) if rows == 1 else (64, 4)
            compile_sm90(gguf_gemm._gguf_dp4a_kernel, {**DP4A, "x_ptr": "*i32" if pre else "*bf16"}, {
                "QTYPE": fmt.type_id, "BYTES": fmt.bytes, "BLOCK_N": block_n, "ROWS": rows, **ends, "ASM": True,
                "PREQUANT": pre}, num_warps=warps)  # fmt: skip
        for (low, asm), planes in cases(lowp, layouts):
            compile_sm90(gguf_blocks._dequantize_kernel, DEQUANT, {
                **args, "BLOCK_N": 64 if low else 16, "LOWP": low, "ASM": asm,
                "WORDS": low and qtype != "Q6_K", "PLANES": planes})  # fmt: skip
        print(qtype, "compiled for sm_90", flush=True)
    for (pairs, x_type), even_k, zeros, serial in cases(((1, "*bf16"), (2, "*fp16")), (False, True), (False, True), (False, True)):
        compile_sm90(wna16._wna16_kernel, {**WNA16, "x_ptr": x_type, "scales_ptr": x_type, "zeros_ptr": x_type,
                                           "final_ptr": x_type}, {
            "BITS": 4, "BLOCK_M": 8, "BLOCK_N": 64, "BLOCK_K": 128, "GROUPS": 0, "HAS_ZEROS": zeros,
            "SPLIT": True, "SERIAL": serial, "DOT_PRECISION": "tf32", "PAIRS": pairs, "LOWP": True,
            "EVEN_K": even_k})  # fmt: skip
    for zeros, ends in cases((False, True), ENDS):
        # the default launch (its channels, or half as many: DP4A_NARROW, and warps); with the L2
        # prefetch (DP4A_PREFETCH_STEPS) once
        prefetch = 2 if zeros and ends["SERIAL"] else 0
        block_n = wna16.DP4A_BLOCK_N // (2 if not zeros and wna16.DP4A_NARROW else 1)
        compile_sm90(wna16._wna16_dp4a_kernel, WNA16_DP4A, {"BLOCK_N": block_n, "HAS_ZEROS": zeros,
                     **ends, "ASM": True, "PREFETCH": prefetch}, num_warps=wna16.DP4A_NUM_WARPS)  # fmt: skip
        compile_sm90(wna16._wna16_dp4a_rows_kernel, WNA16_DP4A_ROWS, {"BLOCK_N": 128, "HAS_ZEROS": zeros, **ends,
                                                                      "ASM": True, "ROWS": 3})  # fmt: skip
    compile_sm90(wna16._wna16_q8_kernel, {"words_ptr": "*i32", "d_ptr": "*fp32", "sum_ptr": "*fp32", "x_ptr": "*bf16",
                                          "k": "i32", "stride_x": "i32"}, {})  # fmt: skip
    print("w4a16 (LOWP, DP4A) compiled for sm_90", flush=True)
    compile_sm90(gguf_gemm._q8_kernel, {"words_ptr": "*i32", "d_ptr": "*fp32", "sum_ptr": "*fp32", "x_ptr": "*bf16",
                                        "stride_x": "i32"}, {})  # fmt: skip
    print("q8 (DP4A's activations) compiled for sm_90", flush=True)
    for int8, ends in cases((False, True), ENDS):
        types = {"part_ptr": "*i32", "xq_ptr": "*i8", "wq_ptr": "*i8"} if int8 else {}
        lines = prefetch_count(fp8_gemm.PREFETCH_STEPS * 512 // 128)  # the default launch's L2 prefetch
        compile_sm90(fp8_gemm._fp8_gemm_rows_kernel, {**FP8, **types}, {
            "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 512, "INT8": int8, "PROMOTE": 128, **ends,
            "PREFETCH_LINES": lines, "ASM": True})  # fmt: skip
    print("the FP8 / INT8 rows kernel (its split slices) compiled for sm_90", flush=True)
    attention = {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                 "q_ptr": "*bf16", "key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16",
                 "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                 "scale_log2": "fp32", "v_scale": "fp32", "num_reqs": "i32", "sliding_window": "i32",
                 **dict.fromkeys(("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs",
                                  "stride_ch", "stride_bt"), "i32")}  # fmt: skip
    for split in (True, False):  # a decode step's tiles at the 8B shape
        compile_sm90(paged_attention._paged_attention_kernel, attention, {
            "GROUP": 4, "HEAD_DIM": 128, "HEAD_DIM_P": 128, "BLOCK_SIZE": 16, "BLOCK_M": 16, "BLOCK_Q": 4,
            "BLOCK_N": 64, "CAUSAL": True, "USE_WINDOW": False, "SPLIT_KV": split, "DOT_PRECISION": "tf32"})  # fmt: skip
    print("paged attention compiled for sm_90", flush=True)
    gate = compile_sm90(host_gate._wait_kernel, {"flag_ptr": "*i64", "ticket": "i32"}, {"MAX": host_gate.MAX_SPINS},
                        num_warps=1)  # fmt: skip
    # each read of the host's flag a volatile (system-scope) load, none hoisted out of the loop
    assert gate.asm["ptx"].count("ld.volatile.global") >= 2, "the gate's reads are not volatile"
    print("the host gate compiled for sm_90", flush=True)


if __name__ == "__main__":
    ALL = "--all" in sys.argv[1:]
    main()
