#!/usr/bin/env bash
# Ferry's one-shot create (prep of both lists + make, then release) against NIXL 1.5.1's
# initialize_xfer + release_xfer_handle, per descriptor, 64 B × 1,024 and 16,384,
# contiguous and shuffled, UCX backend on both sides (the same libucp: the one bundled in
# NIXL's wheel), interleaved rounds, one table (see control_compare.py for what each
# side times).
#
#   backends/ucx/bench/control-compare.sh            # 3 rounds
#   ROUNDS=5 backends/ucx/bench/control-compare.sh
#   FERRY_BENCHES="before=/tmp/a after=/tmp/b" backends/ucx/bench/control-compare.sh
#   KV_LAYERS=1 backends/ucx/bench/control-compare.sh  # 64 layers x 1,024 blocks: Ferry's
#                     plain create and strided prep + make against NIXL's plain lists
#
# The NIXL venv is made as nixl-compare.sh makes it ($NIXL_VENV, default
# /tmp/ferry-nixl-venv; nothing is written inside the repository).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
# shellcheck source=nixl-venv.sh
. "$here/nixl-venv.sh"

# FERRY_BENCHES="before=/path/a after=/path/b" compares prebuilt control_path binaries
# (each LABEL=PATH) instead of building this checkout's.
if [ -n "${FERRY_BENCHES:-}" ]; then
  read -r -a specs <<< "$FERRY_BENCHES"
else
  bench="$(cd "$root" && cargo bench -p ferry-benches --bench control_path --no-run 2>&1 \
    | sed -n 's/.*Executable benches\/control_path.rs (\(.*\))/\1/p' | tail -1)"
  [ -n "$bench" ] || { echo "could not build the control_path benchmark" >&2; exit 1; }
  case "$bench" in /*) ;; *) bench="$root/$bench" ;; esac
  specs=("Ferry=$bench")
fi
args=()
for spec in "${specs[@]}"; do args+=(--ferry-bench "$spec"); done
[ -n "${KV_LAYERS:-}" ] && args+=(--kv-layers)
exec "$venv/bin/python" "$here/control_compare.py" "${args[@]}" \
  --python "$venv/bin/python" --rounds "${ROUNDS:-3}"
