#!/usr/bin/env bash
# Type-checks the mmserve package in place against the SDK's mmserve_client. Config:
# pyproject.toml [tool.mypy]. Extra arguments go to mypy.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-python}
"$python" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.tools/mypy-cache" -p mmserve "$@"
