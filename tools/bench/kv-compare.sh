#!/usr/bin/env bash
# `ferry bench kv` against the same KV-cache loop through NIXL's Python API
# (tools/bench/kv_nixl.py), on NIXL's wheel's libucp for both (Ferry loads it through
# --ucx-library) and one UCX environment, interleaved rounds, one Markdown table.
#
#   tools/bench/kv-compare.sh                 # 3 rounds
#   ROUNDS=5 tools/bench/kv-compare.sh
#   REQUESTS=1000 tools/bench/kv-compare.sh   # timed requests per run (default 500)
#
# Installs nixl-cu12 1.5.1 (no dependencies) and numpy into a throwaway venv
# ($NIXL_VENV, default /tmp/ferry-nixl-venv; backends/ucx/bench/nixl-venv.sh) and builds
# the release `ferry`; nothing is written inside the repository.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# shellcheck source=../../backends/ucx/bench/nixl-venv.sh
. "$root/backends/ucx/bench/nixl-venv.sh"
(cd "$root" && cargo build -q --release -p ferry-tools)
ferry="$(cd "$root" && cd "${CARGO_TARGET_DIR:-target}" && pwd)/release/ferry"
"$venv/bin/python" "$here/kv_compare.py" --ferry "$ferry" --python "$venv/bin/python" \
  --ucx-library "$FERRY_UCX_LIBRARY" --rounds "${ROUNDS:-3}" --requests "${REQUESTS:-500}"
