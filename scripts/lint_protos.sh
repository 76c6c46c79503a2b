#!/usr/bin/env bash
# Lints protos/ with buf (config: buf.yaml at the repo root: STANDARD + COMMENTS).
# Uses $BUF, else the one scripts/setup.sh --test installs (.tools/buf, from npm), else `buf` on
# PATH; without any it says so and exits 0, so the quick loop works on machines without buf.
# With --strict a missing buf is an error (for CI).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
local_buf=$root/.tools/buf/node_modules/.bin/buf
[ -x "$local_buf" ] || local_buf=$(command -v buf || true)
buf=${BUF:-$local_buf}
if [ -z "$buf" ]; then
  echo "lint_protos: buf not found (run scripts/setup.sh --test, or set BUF)" >&2
  [ "${1:-}" = --strict ] && exit 1
  echo "lint_protos: skipping" >&2
  exit 0
fi
"$buf" lint
echo "lint_protos: clean"
