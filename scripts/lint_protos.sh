#!/usr/bin/env bash
# Lints protos/ with buf (config: buf.yaml at the repo root: STANDARD + COMMENTS).
# Uses $BUF, else `buf` on PATH; without either it says so and exits 0, so the quick loop works
# on machines without buf. Install: npm install --prefix /tmp/buf @bufbuild/buf
#                                   export BUF=/tmp/buf/node_modules/.bin/buf
# With --strict a missing buf is an error (for CI).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
buf=${BUF:-$(command -v buf || true)}
if [ -z "$buf" ]; then
  echo "lint_protos: buf not found (set BUF or put buf on PATH); skipping" >&2
  [ "${1:-}" = --strict ] && exit 1
  exit 0
fi
"$buf" lint
echo "lint_protos: clean"
