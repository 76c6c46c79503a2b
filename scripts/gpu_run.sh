#!/usr/bin/env bash
# What the GPU machine runs (device tool): install offline, test the GPU path, benchmark.
# Usage: scripts/gpu_run.sh STAGE...; stages: tests bench quant qtests qkernels int8 kvcap embed structured serve coldstart prefix fp8ttft fp8levers fp8gemm vlm gguf ggufk lowp dp4a ggufquick q6k w4a16 serial sweepdp4a pdl gcab embedhost levers28 s29 s30 s30gguf s30b embedspy s31 s31b s32 s32b s34 s34b s35 s36 s37 s38 s41 s44 s44fp8 (all =
# tests bench); results under $OUT. Carry .whl and bench_data, which scripts/gpu_wheels.sh stages,
# and COMMIT (`git rev-parse --short HEAD > COMMIT` first): the machine's copy of .git can be
# older than the tree it runs (session 29's named the session's first commit all along).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # every call: a warm machine keeps /tmp/site, and .whl may have changed
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . -e clients/python >/dev/null 2>&1 || echo "pip install -e failed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
{ cat COMMIT 2>/dev/null || git rev-parse --short HEAD; } | tee -a "$OUT/gpu.txt"  # COMMIT: a git-archive snapshot
[ -d bench_data ] && export MMSERVE_BENCH_DATA=$PWD/bench_data  # tokenizer copies (bert-base shape)
stages=" ${*:-all} "
[ "$stages" = " all " ] && stages=" tests bench "
has() { [[ "$stages" == *" $1 "* ]]; }
B="python3 -m mmserve.bench.cli bench"
if has tests; then
  python3 -m pytest -q ${TESTS:-tests/kernels tests/gpu} -p no:cacheprovider 2>&1 | tee "$OUT/tests-full.txt" | tail -40 | tee "$OUT/tests.txt"
fi
if has bench; then
  export MMSERVE_BENCH_PROFILE=$OUT/profile.txt
  { $B latency --input-len 128 --output-len 128 --max-num-seqs 1 --baseline
    $B decode --batch-size 1 --input-len 128 --max-num-seqs 1
    $B decode --batch-size 64 --input-len 1024 --max-num-seqs 64
    $B prefill --batch-size 8 --input-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 8 --enforce-eager
    $B throughput --num-requests 1000 --input-len 512 --output-len 128 --baseline
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/bench.txt"
fi
if has qtests; then
  # the quantised paths' GPU tests and kernel microbenchmarks (issue 19)
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_int8_kernels.py tests/kernels/test_wna16.py \
    tests/kernels/test_weight_only_linear.py tests/kernels/test_int8_gemm.py tests/kernels/test_paged_attention.py tests/gpu/test_gpu_int8.py \
    tests/gpu/test_gpu_fp8_kv_cache.py tests/gpu/test_gpu_gguf.py tests/kernels/test_fused_quant_kernels.py \
    tests/gpu/test_gpu_fused_quant.py 2>&1 | tail -30 | tee "$OUT/qtests.txt"
fi
if has qkernels; then
  # their microbenchmarks (6-7 minutes on the H200 with the tests above: two calls)
  { python3 scripts/bench_wna16.py; python3 scripts/bench_int8_gemm.py; python3 scripts/bench_paged_attention_fp8.py
    python3 scripts/bench_fused_quant.py;
    python3 scripts/fp8_kernels.py --rows 1,16,32,48,64; } 2>&1 | tee "$OUT/qkernels.txt"
fi
if has int8; then
  # INT8 w8a8 (issue 19): offline throughput 1000 x 512/128 in bf16 and int8 from the same run (the
  # large GEMM's paths are compared by scripts/bench_int8_gemm.py, in qtests)
  I="throughput --model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --num-requests 1000"
  { $B $I; $B $I --quantization int8; } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/int8.txt"
fi
if has kvcap; then
  # FP8 KV cache: the concurrency that fits at 8k context in the same memory, and its throughput
  K="--model shape:llama3-8b --device cuda --input-len 8064 --output-len 128 --num-requests 64"
  K="$K --max-model-len 8320 --max-num-seqs 64 --gpu-memory-utilization 0.3"
  { $B throughput $K; $B throughput $K --kv-cache-dtype fp8; } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/kvcap.txt"
fi
if has quant; then
  # quantised formats at the 8B shape next to bf16 and FP8 (issue 19): batch-1 latency and decode
  # steps at batch 1-64 (the crossover) in each, throughput 1000 x 512/128 in the 8-bit ones; one
  # engine per format; the random checkpoints are written once under $MMSERVE_CACHE_DIR
  # (bench-checkpoints/: 5.7 GB w4a16, 4.9 GB Q4_K_M, 9.1 GB w8a8-int8, embedding and head in).
  # Not timed yet; estimated 7-8 minutes, most of it engine starts, the w4a16 load (dequantised
  # then repacked on the CPU) and the GGUF's first conversion (its 128k-token vocabulary parsed)
  Q="--model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --num-requests 1000"
  Q="$Q --decode-context 1024 --batch-sizes 1,2,4,8,16,32,64"
  { $B latency,decode,throughput $Q
    $B latency,decode,throughput $Q --quantization fp8
    $B latency,decode $Q --checkpoint-format w4a16-g128
    $B latency,decode $Q --checkpoint-format gguf:Q4_K_M
    $B latency,decode,throughput $Q --checkpoint-format w8a8-int8
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/quant.txt"
fi
if has gguf; then
  # the GGUF Q4_K_M file at the 8B shape alone, next to bf16 from the same call (issue 19)
  Q="--model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --decode-context 1024"
  Q="$Q --batch-sizes ${GGUF_BATCHES:-1,2,4,8,16,32,64}"
  { $B latency,decode $Q; $B latency,decode $Q --checkpoint-format gguf:Q4_K_M
    # then with GGUF_AB's switches, arms apart by ";" (default: the K-quants' LOWP, gguf_gemm.LOWP,
    # the default's opposite)
    arms=${GGUF_AB:-mmserve.kernels.gguf_gemm.LOWP=$(python3 -c "from mmserve.kernels import gguf_gemm; print(not gguf_gemm.LOWP)")}
    IFS=';' read -ra arms <<< "$arms"
    for ab in "${arms[@]}"; do echo "$ab"
      python3 scripts/ab_switch.py $ab -- latency,decode $Q --checkpoint-format gguf:Q4_K_M; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/gguf.txt"
fi
if has ggufk; then
  # the GGUF K-quant kernels (issue 19): their tests in bf16, then scripts/bench_gguf.py
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_gguf.py tests/kernels/test_gguf_gemm.py \
    -k "${GGUFK_TESTS:-gpu or matmul_is or kquant or dequantize or 16_bit}" 2>&1 | tail -8 | tee "$OUT/ggufk-tests.txt"
  python3 scripts/bench_gguf.py 2>&1 | grep --line-buffered -v Warning | tee "$OUT/ggufk.txt"
fi
if has lowp; then
  # the 16-bit dequantisation (gguf_gemm.LOWP, wna16.LOWP; issue 19): w4a16's products checked and
  # timed both ways, the GGUF K-quants' forms checked and timed at 1 and 16 rows (quick mode, with
  # its sweep), then the LOWP tests in bf16 on the device (at most 9.5 minutes: the timeouts)
  { timeout 100 python3 scripts/check_lowp.py
    BENCH_GGUF_QUICK=1 timeout 330 python3 scripts/bench_gguf.py
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/lowp.txt"
  timeout 130 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gguf_gemm.py tests/kernels/test_wna16.py \
    tests/kernels/test_gguf_bits.py -k "lowp or LOWP or bits" 2>&1 | tail -30 | tee "$OUT/lowp-tests.txt"
fi
if has dp4a; then
  # the one-row products with int8 activations (gguf_gemm.DP4A, wna16.DP4A; issue 19): the GGUF and
  # w4a16 tests in bf16 on the device, then check_lowp.py (w4a16's forms, its dp4a at one row)
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_gguf.py tests/gpu/test_gpu_quantized_decode.py tests/kernels/test_gguf_gemm.py tests/kernels/test_wna16.py \
    -k "gpu or int8 or one_row or matmul_is or dequantised_product" 2>&1 | tail -12 | tee "$OUT/dp4a-tests.txt"
  timeout 180 python3 scripts/check_lowp.py 2>&1 | grep --line-buffered -v Warning | tee "$OUT/dp4a.txt"
fi
if has ggufquick; then
  # bench_gguf's quick mode: its checks, the GGUF forms at 1, 4 and 16 rows, DP4A's forms (at most 7.5 minutes)
  BENCH_GGUF_QUICK=1 timeout 450 python3 scripts/bench_gguf.py 2>&1 | grep --line-buffered -v Warning | tee "$OUT/ggufquick.txt"
fi
if has q6k; then
  # Q6_K in planes (gguf_gemm.Q6K_ALIGNED; issue 19): its tests in bf16 on the device, its products
  # at 1 and 2 rows (bench_gguf's Q6_K mode: blocks against planes, the Q4_K_M 8B file's Q6_K
  # shapes), then the Q4_K_M 8B decode with the switch off (the default) and on (about 8 minutes)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gguf_q6k_planes.py tests/kernels/test_gguf_gemm.py \
    tests/gpu/test_gpu_gguf.py -k "q6k or Q6_K" 2>&1 | tail -8 | tee "$OUT/q6k-tests.txt"
  { BENCH_GGUF_Q6K=1 timeout 120 python3 scripts/bench_gguf.py
    Q="--model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --decode-context 1024"
    Q="$Q --batch-sizes 1,2 --checkpoint-format gguf:Q4_K_M"
    $B latency,decode $Q; echo "mmserve.kernels.gguf_gemm.Q6K_ALIGNED=True"
    python3 scripts/ab_switch.py mmserve.kernels.gguf_gemm.Q6K_ALIGNED=True -- latency,decode $Q
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/q6k.txt"
fi
if has w4a16; then
  # w4a16 g128 at the 8B shape, batch 1 (or W4A16_BATCHES; issue 19): bf16, w4a16 with the
  # defaults, then with W4A16_AB's switches, arms apart by ";" (default: the int8-activation
  # product up to 4 rows, wna16.DP4A_MAX_ROWS=4)
  Q="--model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --decode-context 1024"
  Q="$Q --batch-sizes ${W4A16_BATCHES:-1}"
  { $B latency,decode $Q; $B latency,decode $Q --checkpoint-format w4a16-g128
    IFS=';' read -ra arms <<< "${W4A16_AB:-mmserve.kernels.wna16.DP4A_MAX_ROWS=4}"
    for ab in "${arms[@]}"; do echo "$ab"
      python3 scripts/ab_switch.py $ab -- latency,decode $Q --checkpoint-format w4a16-g128; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/w4a16.txt"
fi
if has serial; then
  # split products finished by their last program (_common.SERIAL_SPLITS; issues 19, 23): its tests
  # on the device (each product 50 times, to the bit), then FP8's batch-1 decode (target 1) and
  # w4a16-g128's and the Q4_K_M file's at batch 1 and 4, each with it off and on (the default's
  # kernels profiled in profile-w4a16-g128.txt and profile-gguf.txt)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_serial_splits.py 2>&1 | tail -5 | tee "$OUT/serial-tests.txt"
  S=mmserve.kernels._common.SERIAL_SPLITS=True
  L="latency --input-len 128 --output-len 128 --max-num-seqs 1 --load-format dummy --quantization fp8"
  Q="--model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --decode-context 1024 --batch-sizes 1,4"
  { $B $L; echo "$S"; python3 scripts/ab_switch.py $S -- $L
    for f in w4a16-g128 gguf:Q4_K_M; do  # (the default's decode steps profiled: where a step goes)
      MMSERVE_BENCH_PROFILE=$OUT/profile-${f%%:*}.txt $B latency,decode $Q --checkpoint-format $f; echo "$S"
      python3 scripts/ab_switch.py $S -- latency,decode $Q --checkpoint-format $f
    done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/serial.txt"
fi
if has pdl; then
  # programmatic dependent launch (_common.PDL, on; issues 19, 23 target 1): its chain test and
  # the GPU tests under it, then batch-1 decode on (the default) and off: FP8 latency, and
  # w4a16-g128's and the Q4_K_M file's latency and decode steps at batch 1 and 2
  timeout ${PDL_TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider ${PDL_TESTS:-tests/gpu/test_gpu_pdl.py tests/gpu/test_gpu_quantized_decode.py tests/gpu/test_gpu_engine.py} 2>&1 | tail -12 | tee "$OUT/pdl-tests.txt"
  S=mmserve.kernels._common.PDL=False
  L="latency --input-len 128 --output-len 128 --max-num-seqs 1 --load-format dummy --quantization fp8"
  Q="--model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --decode-context 1024 --batch-sizes 1,2"
  { $B $L; echo "$S"; python3 scripts/ab_switch.py $S -- $L
    for f in ${PDL_FORMATS:-w4a16-g128 gguf:Q4_K_M}; do
      $B latency,decode $Q --checkpoint-format $f; echo "$S"
      python3 scripts/ab_switch.py $S -- latency,decode $Q --checkpoint-format $f
    done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/pdl.txt"
fi
if has sweepdp4a; then
  # w4a16's one-row int8-activation product over its launch knobs (issue 19): programs per SM,
  # warps, pipeline depth, channels a program, L2 prefetch; a copy of the same bytes as the card's
  # bandwidth. SWEEP_ARGS: the script's arguments (for instance --quick, or --config lists)
  timeout ${SWEEP_TIMEOUT:-240} python3 scripts/sweep_dp4a.py ${SWEEP_ARGS:-} 2>&1 | grep --line-buffered -v Warning | tee "$OUT/sweepdp4a.txt"
fi
if has levers28; then
  # session 28's untimed levers (issues 19, 23), about 8 minutes on a fresh machine: w4a16's
  # one-row product with its first steps prefetched to L2, and the several-row kernel at one
  # warp (the products alone); then batch-1 decode in the engine: w4a16 with the one-warp
  # default against 4 warps, and with the prefetch; FP8 with and without its prefetch
  S="python3 scripts/sweep_dp4a.py"
  { timeout 100 $S --config DP4A_PREFETCH_STEPS=0 --config DP4A_PREFETCH_STEPS=1 --config DP4A_PREFETCH_STEPS=2 \
      --config DP4A_PREFETCH_STEPS=4
    for rows in 2 4; do
      timeout 60 $S --rows $rows --config DP4A_ROWS_NUM_WARPS=4 --config DP4A_ROWS_NUM_WARPS=1 \
        --config DP4A_ROWS_NUM_WARPS=1,PROGRAMS_PER_SM=8
    done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/levers28-kernels.txt"
  Q="--model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --decode-context 1024 --batch-sizes 1"
  W="$Q --checkpoint-format w4a16-g128"
  { $B latency,decode $W
    python3 scripts/ab_switch.py mmserve.kernels.wna16.DP4A_NUM_WARPS=4 mmserve.kernels.wna16.DP4A_PROGRAMS_PER_SM=4 \
      -- latency,decode $W
    python3 scripts/ab_switch.py mmserve.kernels.wna16.DP4A_PREFETCH_STEPS=2 -- latency,decode $W
    $B latency,decode $Q --quantization fp8
    python3 scripts/ab_switch.py mmserve.kernels.fp8_gemm.PREFETCH_STEPS=2 -- latency,decode $Q --quantization fp8
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/levers28.txt"
fi
if has s29; then
  # session 29 (issue 23, targets 5 and 6), about 7 minutes: constrained decoding at batch 64
  # with bench structured's grammar in the form xgrammar fills fast; TTFT at 8 req/s in bf16
  # and FP8 with prefill_graph_tokens' defaults (256; 1024 with FP8/INT8); FP8's batch-1 latency
  # with its L2 prefetch (the default) and without; INT8 at 256 and 1024
  S="--model shape:llama3-8b --load-format dummy --request-rate 8 --num-requests 240 --input-len 512"
  S="$S --output-len 128 --engine-process"
  { $B structured --model shape:llama3-8b --load-format dummy --batch-sizes 64 --input-len 128 \
      --output-len 128 --max-num-seqs 64 --compile-repeats 1
    $B serve $S; $B serve $S --quantization fp8
    L="latency --input-len 128 --output-len 128 --max-num-seqs 1 --load-format dummy --quantization fp8"
    $B $L; python3 scripts/ab_switch.py mmserve.kernels.fp8_gemm.PREFETCH_STEPS=0 -- $L
    for g in 256 1024; do $B serve $S --quantization int8 --prefill-graph-tokens $g; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s29.txt"
fi
if has s30; then
  # session 29's untimed changes (issues 19, 23): constrained decoding at batch 1 and 64 with the
  # grammar-mask warm-up (target 6; any "compiled while serving" line is a miss), TTFT at 8 req/s
  # in bf16 and FP8 with their default prefill graphs (target 5), about 6 minutes
  S="--model shape:llama3-8b --load-format dummy --request-rate 8 --num-requests 240 --input-len 512"
  S="$S --output-len 128 --engine-process"
  { $B structured --model shape:llama3-8b --load-format dummy --batch-sizes 1,64 --input-len 128 \
      --output-len 128 --max-num-seqs 64 --compile-repeats 1
    $B serve $S; $B serve $S --quantization fp8
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s30.txt"
fi
if has s30gguf; then
  # Q4_K's one-row DP4A tile (gguf_gemm.DP4A_ONE_ROW_TILE, c387a21) in the engine: the Q4_K_M
  # file at batch 1 and 2 with it and without; the warm-up's few-row waves (25fdc12): any
  # "compiled while serving" line is one they missed
  Q="--model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --decode-context 1024"
  Q="$Q --batch-sizes 1,2 --checkpoint-format gguf:Q4_K_M"
  { $B latency,decode $Q; echo "mmserve.kernels.gguf_gemm.DP4A_ONE_ROW_TILE={}"
    python3 scripts/ab_switch.py "mmserve.kernels.gguf_gemm.DP4A_ONE_ROW_TILE={}" -- latency,decode $Q
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s30gguf.txt"
fi
if has s30b; then
  # the grammar masks' copy on its own stream (model_runner.MASK_COPY_STREAM, session 30): the
  # GPU test of constrained outputs, then constrained decoding at batch 1 and 64 with the copy
  # stream and without (target 6), about 5 minutes
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_structured.py 2>&1 | tail -5
  T="structured --model shape:llama3-8b --load-format dummy --batch-sizes 1,64 --input-len 128"
  T="$T --output-len 128 --max-num-seqs 64 --compile-repeats 1"
  { $B $T; echo "mmserve.runner.model_runner.MASK_COPY_STREAM=False"
    python3 scripts/ab_switch.py mmserve.runner.model_runner.MASK_COPY_STREAM=False -- $T
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s30b.txt"
fi
if has embedspy; then
  # one gRPC client's Embed calls sampled with py-spy (issue 23 target 4; carry its wheel in .whl),
  # the server with its engine process and the client, then bench embed for the same call's ratios
  PATH=/tmp/site/bin:$PATH python3 scripts/embed_grpc_profile.py --model shape:bert-base --device cuda \
    --out "$OUT" > /dev/null 2>&1; head -c 20000 "$OUT/embed_grpc_profile.txt"
  $B embed --model shape:bert-base --device cuda --batch-size 64 --seq-len 128 2>&1 | grep --line-buffered -v Warning | tee "$OUT/embed.txt"
fi
if has gcab; then
  # the start-up heap frozen out of the garbage collector (mmserve.heap) and not: offline
  # throughput 1000 x 512/128 (two rounds in each engine; prefix caching on and off, issue 23
  # targets 2 and 3) and constrained decoding at batch 64 (target 6, with the host's time by part)
  T="throughput --model shape:llama3-8b --load-format dummy --input-len 512 --output-len 128"
  T="$T --num-requests 1000 --rounds 2"
  S="structured --model shape:llama3-8b --load-format dummy --batch-sizes 64 --input-len 128"
  S="$S --output-len 128 --max-num-seqs 64 --compile-repeats 1"
  { $B $T; MMSERVE_GC_FREEZE=0 $B $T
    $B $T --no-enable-prefix-caching
    $B $S; MMSERVE_GC_FREEZE=0 $B $S
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/gcab.txt"
fi
if has embedhost; then
  # where one offline Embed call's time goes (issue 23, target 4): bert-base shape, 64 x 128, a
  # call in halves on the idle engine (the default) and whole (--min-chunk 64)
  { python3 scripts/embed_host.py --device cuda; python3 scripts/embed_host.py --device cuda --min-chunk 64
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/embedhost.txt"
fi
if has embed; then
  $B embed --model shape:bert-base --device cuda --batch-size 64 --seq-len 128 2>&1 | grep --line-buffered -v Warning | tee "$OUT/embed.txt"
fi
if has structured; then
  $B structured --model shape:llama3-8b --load-format dummy --batch-sizes 1,64 --input-len 128 --output-len 128 --max-num-seqs 64 2>&1 | grep --line-buffered -v Warning | tee "$OUT/structured.txt"
fi
if has serve; then
  $B serve --model shape:llama3-8b --load-format dummy --request-rate 8,32 --num-requests 300 --input-len 512 --output-len 128 --engine-process 2>&1 | grep --line-buffered -v Warning | tee "$OUT/serve.txt"
fi
if has coldstart; then
  # issue 23, target 7: a fresh server's first minute (an empty Triton cache) at 8 req/s, then the
  # same server's second minute (warm), without and with the start-up warm-up; serve-start
  # lines give each start-up's seconds
  C="--model shape:llama3-8b --load-format dummy --request-rate 8,8 --num-requests ${COLD_REQUESTS:-480} --num-warmup 0"
  C="$C --input-len 512 --output-len 128"
  { TRITON_CACHE_DIR=$(mktemp -d) $B serve $C --no-warmup
    TRITON_CACHE_DIR=$(mktemp -d) $B serve $C --warmup
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/coldstart.txt"
fi
if has prefix; then
  # issue 23, target 3: TTFT on a prefix-cache miss and hit (a 4,096-token system prompt and a
  # 64-token turn), and offline throughput at 0% hits with prefix caching on and off
  T="throughput --model shape:llama3-8b --device cuda --input-len 512 --output-len 128 --num-requests 1000"
  { $B prefix --model shape:llama3-8b --load-format dummy
    $B $T; $B $T --no-enable-prefix-caching
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/prefix.txt"
fi
if has fp8ttft; then
  # issue 23, target 5: TTFT at 8 req/s, bf16 against FP8, with prefill-step graphs up to 256
  # tokens (the default) and up to 1024 (covering a 512-token prompt beside the decodes)
  S="--model shape:llama3-8b --load-format dummy --request-rate 8 --num-requests 240 --input-len 512"
  S="$S --output-len 128 --engine-process"
  # (first where one 512-token prefill's time goes in each: profiles in prefill-{bf16,fp8}.txt)
  P="prefill --model shape:llama3-8b --load-format dummy --batch-size 1 --input-len 512"
  { MMSERVE_BENCH_PROFILE=$OUT/prefill-bf16.txt $B $P; MMSERVE_BENCH_PROFILE=$OUT/prefill-fp8.txt $B $P --quantization fp8
    for q in "" "--quantization fp8"; do for g in 256 1024; do
      $B serve $S $q --prefill-graph-tokens $g; done; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/fp8ttft.txt"
fi
if has fp8levers; then
  # issue 23 target 1: FP8 batch-1 decode with the rows kernel's split-K and the fused activation
  # quantisation each off and on (scripts/ab_switch.py sets the switches in-process)
  L="latency --input-len 128 --output-len 128 --max-num-seqs 1 --load-format dummy --quantization fp8"
  for sw in "0 False" "64 False" "0 True" "64 True"; do set -- $sw
    echo "SPLIT_BELOW=$1 FUSE_ACTIVATION_QUANT=$2"
    python3 scripts/ab_switch.py mmserve.kernels.fp8_gemm.SPLIT_BELOW=$1 \
      mmserve.models.quantized_input.FUSE_ACTIVATION_QUANT=$2 -- $L
  done 2>&1 | grep --line-buffered -v Warning | tee "$OUT/fp8levers.txt"
fi
if has fp8gemm; then
  # issue 23 targets 2 and 5: FP8 products past 32 rows (torch._scaled_mm, with fast accumulation,
  # on padded rows), then throughput 1000 x 512/128 with models/fp8.py's row padding off and on,
  # bf16 in the same run
  T="throughput --model shape:llama3-8b --load-format dummy --input-len 512 --output-len 128 --num-requests 1000"
  { python3 scripts/fp8_kernels.py --rows 256,512,518,1024,1030,4096
    $B $T
    for p in 0 128; do echo "PAD_ROWS=$p"
      python3 scripts/ab_switch.py mmserve.models.fp8.PAD_ROWS=$p -- $T --quantization fp8; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/fp8gemm.txt"
fi
if has vlm; then
  $B vlm --model shape:qwen2-vl-7b --load-format dummy --baseline 2>&1 | grep --line-buffered -v Warning | tee "$OUT/vlm.txt"
fi
if has s31; then
  # FP8's few-rows product at 33-64 rows (models/fp8.py FEW_ROWS was 32: kernels/fp8_gemm.py's
  # 64-row tile with its float32 promotion was tested, never timed; 64 since session 31): its
  # tests in bf16, the products alone, then FP8 throughput 1000 x 512/128 and the batch-64 decode
  # step with FEW_ROWS 32 and 64, alternated
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm.py 2>&1 | tail -3 | tee "$OUT/s31-tests.txt"
  T="throughput --model shape:llama3-8b --load-format dummy --input-len 512 --output-len 128 --num-requests 1000 --quantization fp8"
  D="decode --model shape:llama3-8b --load-format dummy --batch-size 64 --input-len 1024 --max-num-seqs 64 --quantization fp8"
  { python3 scripts/fp8_kernels.py --rows 32,48,64
    for few in 32 64; do echo "FEW_ROWS=$few"; python3 scripts/ab_switch.py mmserve.models.fp8.FEW_ROWS=$few -- $T; done
    for few in 32 64; do echo "FEW_ROWS=$few"; python3 scripts/ab_switch.py mmserve.models.fp8.FEW_ROWS=$few -- $D; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s31.txt"
fi
if has s31b; then
  # constrained decoding at batch 64 on the H200 (target 6; +17.5% in s30 at a09dc83, the host's
  # fill 3.3 ms a step): the fill on 8 threads (the default: half of 16 CPUs) against 14
  Z="structured --model shape:llama3-8b --load-format dummy --batch-sizes 64 --input-len 128 --output-len 128"
  Z="$Z --max-num-seqs 64 --compile-repeats 1"
  for t in 14 None; do echo "FILL_THREADS=$t"
    python3 scripts/ab_switch.py mmserve.structured_output.backend.FILL_THREADS=$t -- $Z; done 2>&1 \
    | grep --line-buffered -v Warning | grep --line-buffered -v fix_mistral | tee "$OUT/s31b.txt"
fi
if has s32; then
  # target 6: the grammar masks filled on a thread of their own, the copy stream waiting for the
  # fill on the device (model_runner.MASK_FILL_THREAD, host_gate), against the fill in line:
  # its tests in bf16 (SKIP_TESTS=1: not), then batch 1 and 64 constrained and free, alternated
  # (about 2.5 minutes on an H100)
  [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/kernels/test_host_gate.py tests/gpu/test_gpu_structured.py \
    tests/engine/test_async_scheduling.py 2>&1 | tail -5 | tee "$OUT/s32-tests.txt"
  Z="structured --model shape:llama3-8b --load-format dummy --batch-sizes 1,64 --input-len 128 --output-len 128"
  Z="$Z --max-num-seqs 64 --compile-repeats 1"
  for t in None False; do echo "MASK_FILL_THREAD=$t"
    python3 scripts/ab_switch.py mmserve.runner.model_runner.MASK_FILL_THREAD=$t -- $Z; done 2>&1 \
    | grep --line-buffered -v Warning | grep --line-buffered -v fix_mistral | tee "$OUT/s32.txt"
fi
if has s32b; then
  # INT8 w8a8's products of 33-64 rows on the rows kernel (models/int8.py FEW_ROWS 32 -> 64?, as
  # FP8's in s31): the batch-48 and batch-64 decode steps at 1k context, alternated
  for b in 48 64; do
    D="decode --model shape:llama3-8b --load-format dummy --batch-size $b --input-len 1024 --max-num-seqs 64"
    for few in 32 64 32 64; do echo "batch $b FEW_ROWS=$few"
      python3 scripts/ab_switch.py mmserve.models.int8.FEW_ROWS=$few -- $D --quantization int8; done
  done 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s32b.txt"
fi
if has s34; then
  # target 2: offline throughput 1000 x 512/128 against the running limit and the step's token
  # budget (the bench's 256 / 8192; vLLM's offline defaults on 80-GB-class GPUs are 1024 /
  # 16384): bf16, then FP8, then FP8 with the FP8 KV cache (about 6 minutes on an H100)
  T="throughput --model shape:llama3-8b --load-format dummy --input-len 512 --output-len 128 --num-requests 1000"
  { for cfg in "256 8192" "1024 16384" "512 16384" "256 8192 --quantization fp8" "1024 16384 --quantization fp8" \
      "1024 16384 --quantization fp8 --kv-cache-dtype fp8"; do
      set -- $cfg; echo "SEQS=$1 TOKENS=$2 ${*:3}"; $B $T --max-num-seqs $1 --max-num-batched-tokens $2 "${@:3}"; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s34.txt"
fi
if has s34b; then
  # target 1: bf16 products through cuBLASLt (TORCH_BLAS_PREFER_CUBLASLT=1) against cuBLAS, batch
  # 1 and the batch-64 decode step, alternated
  L="latency --model shape:llama3-8b --load-format dummy --input-len 128 --output-len 128 --max-num-seqs 1"
  D="decode --model shape:llama3-8b --load-format dummy --batch-size 64 --input-len 1024 --max-num-seqs 64"
  { for lt in 0 1 0 1; do echo "TORCH_BLAS_PREFER_CUBLASLT=$lt"; TORCH_BLAS_PREFER_CUBLASLT=$lt $B $L; done
    for lt in 0 1; do echo "TORCH_BLAS_PREFER_CUBLASLT=$lt"; TORCH_BLAS_PREFER_CUBLASLT=$lt $B $D; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s34b.txt"
fi
if has s35; then
  # why bf16's decode steps of 500-900 rows cost 76-90 us a row offline (s34) against FP8's 46 and
  # bf16's own 53 at 245 rows: the decode step at 256 rows (a CUDA graph) and 512 (eager), bf16
  # and FP8, each profiled (torch profiler, 5 steps: $OUT/profile-*.txt)
  for q in bf16 fp8; do for b in 256 512; do
    flag=""; [ $q = fp8 ] && flag="--quantization fp8"; echo "$q batch $b"
    MMSERVE_BENCH_PROFILE=$OUT/profile-$q-$b.txt $B decode --model shape:llama3-8b --load-format dummy \
      --batch-size $b --input-len 512 --max-num-seqs $b $flag; done; done 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s35.txt"
fi
# FP8's one row on scaled_gemv (fp8_gemm.ONE_ROW_GEMV) against the rows kernel, alternated
L44="latency --model shape:llama3-8b --load-format dummy --input-len 128 --output-len 128 --max-num-seqs 1"
fp8_one_row_ab() {
  for t in True False True; do echo "ONE_ROW_GEMV=$t fp8"
    python3 scripts/ab_switch.py mmserve.kernels.fp8_gemm.ONE_ROW_GEMV=$t -- $L44 --quantization fp8; done
}
if has s44fp8; then
  # s44's first question alone (about 2 minutes, no tests), for the H200
  fp8_one_row_ab 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s44fp8.txt"
fi
if has s44; then
  # session 43's decisions from an H100, on the card the targets name: FP8's one row on scaled_gemv
  # (fp8_gemm.ONE_ROW_GEMV, now on) and w4a16's one row in 64-channel tiles (wna16.DP4A_NARROW, now
  # on), each against its old path in alternation; then bf16, INT8 and Q4_K_M at batch 1 for the
  # record. Tests first (SKIP_TESTS=1: not); about 8 minutes
  [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm.py \
    tests/kernels/test_dense_gemv.py tests/kernels/test_wna16.py tests/gpu/test_gpu_engine.py \
    -k "fp8 or scaled_gemv or takes_one_row or matches or one_row_in_int8" 2>&1 | tail -3 | tee "$OUT/s44-tests.txt"
  { L=$L44
    fp8_one_row_ab
    W="latency --model shape:llama3-8b --input-len 128 --output-len 128 --max-num-seqs 1"
    for t in True False True; do echo "DP4A_NARROW=$t w4a16-g128"
      python3 scripts/ab_switch.py mmserve.kernels.wna16.DP4A_NARROW=$t -- $W --checkpoint-format w4a16-g128; done
    echo "bf16"; $B $L
    echo "int8"; $B $L --quantization int8
    echo "gguf:Q4_K_M"; $B $W --checkpoint-format gguf:Q4_K_M
  } 2>&1 | grep --line-buffered -v Warning | grep --line-buffered -v fix_mistral | tee "$OUT/s44.txt"
fi
if has s41; then
  # issue 19's batch-1 gap (w4a16-g128 2.31 ms against its 1.11 ms floor, Q4_K_M 3.01 against
  # 1.12): where the step goes, each kernel's own time (PDL off; the checkpoints written once, as
  # in quant), then w4a16's one-row product over its launch settings on this card
  D="decode --model shape:llama3-8b --device cuda --batch-size 1 --input-len 128 --max-num-seqs 1"
  { for f in w4a16-g128 gguf:Q4_K_M; do echo "FORMAT=$f"
      MMSERVE_BENCH_PROFILE=$OUT/profile-b1-${f/:/-}.txt python3 scripts/ab_switch.py mmserve.kernels._common.PDL=False \
        -- $D --checkpoint-format $f; done
    python3 scripts/sweep_dp4a.py --quick
    # one row with its activations quantised first (a launch of its own) on the rows kernel
    python3 scripts/sweep_dp4a.py --config DP4A_FUSED_ONE_ROW=1 --config DP4A_FUSED_ONE_ROW=0 \
      --config DP4A_FUSED_ONE_ROW=0,DP4A_ROWS_NUM_WARPS=1,PROGRAMS_PER_SM=8 \
      --config DP4A_FUSED_ONE_ROW=0,DP4A_ROWS_NUM_WARPS=2,PROGRAMS_PER_SM=8 --config DP4A_AHEAD=1 \
      --config DP4A_AHEAD=1,DP4A_PROGRAMS_PER_SM=16 --config DP4A_AHEAD=1,DP4A_NUM_WARPS=2 \
      --config DP4A_BLOCK_N=64 --config DP4A_BLOCK_N=64,DP4A_PROGRAMS_PER_SM=4
    # (64 channels a program: fewer K splits for o and qkv, whose one-step slices were 49% / 58%
    # of the H100's bandwidth in session 41; 2.47 SASS instructions a weight against 1.90)
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s41.txt"
fi
if has s38; then
  # target 1: where bf16's batch-1 decode step goes (4.5 ms against the 3.59 ms floor): the step
  # at 128 context profiled with PDL off (each kernel's own time: under PDL a kernel's time holds
  # its wait for the one before) and on, then the step's time in each
  D="decode --model shape:llama3-8b --load-format dummy --batch-size 1 --input-len 128 --max-num-seqs 1"
  { for pdl in False True; do echo "PDL=$pdl"
      MMSERVE_BENCH_PROFILE=$OUT/profile-b1-pdl$pdl.txt python3 scripts/ab_switch.py mmserve.kernels._common.PDL=$pdl -- $D; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s38.txt"
fi
if has s36; then
  # target 2: where bf16's offline step goes at 256 / 8192 and 1024 / 16384 (the engine thread's ms
  # a step by part, host_ms_per_step, beside the device's step breakdown): is the host the pace?
  T="throughput --model shape:llama3-8b --load-format dummy --input-len 512 --output-len 128 --num-requests 1000"
  { for cfg in "1024 16384" "256 8192"; do set -- $cfg; echo "SEQS=$1 TOKENS=$2"
      $B $T --max-num-seqs $1 --max-num-batched-tokens $2; done
  } 2>&1 | grep --line-buffered -v Warning | tee "$OUT/s36.txt"
fi
if has s37; then
  # target 6: the step before's tokens into the matchers on the filler's thread, right before the
  # fill (model_runner.EARLY_ACCEPT), against the update's accept and then the fill (session
  # 34's): their tests in bf16 (SKIP_TESTS=1: not), then batch 1 and 64 constrained and free,
  # alternated
  [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/kernels/test_host_gate.py tests/gpu/test_gpu_structured.py \
    tests/engine/test_async_scheduling.py 2>&1 | tail -5 | tee "$OUT/s37-tests.txt"
  Z="structured --model shape:llama3-8b --load-format dummy --batch-sizes 1,64 --input-len 128 --output-len 128"
  Z="$Z --max-num-seqs 64 --compile-repeats 1"
  for t in ${S37_ARMS:-True False True False}; do echo "EARLY_ACCEPT=$t"
    python3 scripts/ab_switch.py mmserve.runner.model_runner.EARLY_ACCEPT=$t -- $Z; done 2>&1 \
    | grep --line-buffered -v Warning | grep --line-buffered -v fix_mistral | tee "$OUT/s37.txt"
fi
