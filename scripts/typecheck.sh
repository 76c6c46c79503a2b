#!/usr/bin/env bash
# Type-checks the mmserve distribution as it is installed: mmserve/, with kernels/ as
# mmserve.kernels and processors/ as mmserve.processors ([tool.setuptools.package-dir]), against
# the SDK's mmserve_client. Config: pyproject.toml [tool.mypy].
#
# mypy cannot follow the editable install's import hook, so checked in place it would not find
# mmserve.kernels / mmserve.processors and (ignore_missing_imports) would treat them as Any. The
# package is therefore laid out as symlinks in .tools/mypy (git-ignored) and checked there; the
# report names the repository's paths. Extra arguments go to mypy.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-python}
tree=$root/.tools/mypy

rm -rf "$tree"
mkdir -p "$tree/mmserve"
for entry in mmserve/*; do
  ln -s "$root/$entry" "$tree/mmserve/"
done
ln -s "$root/kernels" "$tree/mmserve/kernels"
ln -s "$root/processors" "$tree/mmserve/processors"

cd "$tree"
"$python" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.tools/mypy-cache" \
  -p mmserve "$@" | sed -E 's#^mmserve/(kernels|processors)/#\1/#'
