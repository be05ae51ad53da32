#!/usr/bin/env bash
# Ferry's UCX benchmark against NIXL's Python API on the SAME libucp (the one bundled in
# NIXL's wheel) and the same UCX environment, interleaved rounds, one table.
#
#   backends/ucx/bench/nixl-compare.sh            # 3 rounds
#   ROUNDS=5 backends/ucx/bench/nixl-compare.sh
#   ROUNDS=8 ONLY=tcp:1048576:32 backends/ucx/bench/nixl-compare.sh   # one row, paired
#   MAX_ITERS=10000 backends/ucx/bench/nixl-compare.sh   # the same request cap, both sides
#
# ONLY (comma list of VARIANT:BLOCK:COUNT) runs just those rows, prints each round's
# Ferry ÷ NIXL beside the table, and leaves out the metadata, control-path and perftest
# parts (CONTROL=1 / PERFTEST=1 bring those back).
# Installs nixl-cu12 (no dependencies: the UCX backend needs neither torch nor CUDA)
# and numpy into a throwaway venv ($NIXL_VENV, default /tmp/ferry-nixl-venv); nothing
# is written inside the repository. Both sides: two processes on this host,
# UCX_NET_DEVICES=lo, the UCX settings listed in nixl_compare.py, no progress thread
# (NIXL's agent progress threads are turned off; both targets progress in a loop).
# Also the metadata of 15,000 UCX-registered regions (blob bytes, encode, load into a
# fresh agent): FERRY_BENCH_UCX_METADATA beside nixl_md.py; then control-compare.sh
# (CONTROL=0 skips it) and perftest-compare.sh (PERFTEST=0 skips it). Each 1 MiB row
# also gets its link's limit in the same rounds: iperf3 on tcp, memcpy on shared memory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
# shellcheck source=nixl-venv.sh
. "$here/nixl-venv.sh"

# The tcp rows' limit is one plain TCP stream (iperf3, a Debian package).
if ! command -v iperf3 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iperf3 \
      >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends iperf3 >/dev/null; }
  else
    echo "iperf3 not found: install the Debian package 'iperf3'" >&2
    exit 1
  fi
fi
bench="$(cd "$root" && cargo bench -p ferry-benches --bench ucx --no-run 2>&1 \
  | sed -n 's/.*Executable benches\/ucx.rs (\(.*\))/\1/p' | tail -1)"
[ -n "$bench" ] || { echo "could not build the UCX benchmark" >&2; exit 1; }
case "$bench" in /*) ;; *) bench="$root/$bench" ;; esac  # absolute under CARGO_TARGET_DIR
"$venv/bin/python" "$here/nixl_compare.py" --ferry-bench "$bench" \
  --python "$venv/bin/python" --rounds "${ROUNDS:-3}" --only "${ONLY:-}" \
  --max-iters "${MAX_ITERS:-0}"

# The rest of issue 12's table, in the same run: the control path against NIXL's
# initialize_xfer (same libucp), then ucx_perftest against Ferry's bench on the
# system's UCX (perftest comes with ucx-utils, not with the wheel). CONTROL=0 or
# PERFTEST=0 leaves one out.
default_rest=1
[ -n "${ONLY:-}" ] && default_rest=0
if [ "${CONTROL:-$default_rest}" != 0 ]; then
  echo
  ROUNDS="${ROUNDS:-3}" "$here/control-compare.sh"
fi
if [ "${PERFTEST:-$default_rest}" != 0 ]; then
  echo
  env -u FERRY_UCX_LIBRARY ROUNDS="${ROUNDS:-3}" "$here/perftest-compare.sh"
fi
