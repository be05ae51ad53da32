#!/usr/bin/env bash
# Ferry's UCX bench against ucx_perftest (Debian ucx-utils) put bandwidth, side by side in
# one run: the same libucp (the system's; ucx_perftest links it, and Ferry loads
# libucp.so.0 unless FERRY_UCX_LIBRARY says otherwise), the same transport, the same
# message size, one buffer reused on each side (perftest's `-s SIZE` buffer; Ferry's
# 1 MiB × 1 case), and the same UCX environment for both: every UCX_* setting Ferry
# applies to itself (state/config.rs) is exported for both processes of both tools.
#
# ucx_perftest's server listens on every address, so each round runs inside a private
# network namespace (`unshare -n`) where only `lo` is up; Ferry runs in the same one.
# Needs root (or user namespaces) and ucx-utils.
#
#   backends/ucx/bench/perftest-compare.sh                 # shm and tcp, 3 rounds
#   ROUNDS=5 TLS_LIST=tcp backends/ucx/bench/perftest-compare.sh
#
# Cases per transport, interleaved within each round:
#   perftest    ucp_put_bw, buffers from ucp_mem_map(ALLOCATE) (what perftest does); its
#               puts stream: one flush after all ITERS of them
#   ferry/ucx   FERRY_BENCH_UCX_ALLOC=ucx: both buffers from Agent::alloc (the same kind
#               of memory as perftest's); WRITE 1 MiB × 1 (one put and one flush per
#               request, timed post until done) and × 32 (32 puts, one flush)
#   ferry/own   the same with the bench's own (caller-allocated) buffers, as an
#               application's
# The order of the three alternates between rounds (perftest first, then Ferry first).
# Per transport: shm = default UCX_TLS, no error handling (perftest's default, Ferry
# error_handling=none); tcp = UCX_TLS=tcp, peer error handling (perftest -e, Ferry
# error_handling=peer). Printed: medians over rounds of GB/s (1e9 B/s): perftest's
# overall bandwidth and its median-latency bandwidth (size / 50th percentile), Ferry's
# bandwidth at the median request time (post until done), and Ferry ÷ perftest for both
# (the median-latency figure on shm only: over tcp a put's latency is the time to queue it).
set -euo pipefail
command -v ucx_perftest >/dev/null || { echo "missing ucx_perftest: apt-get install ucx-utils" >&2; exit 1; }
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
SIZE="${SIZE:-1048576}"
TLS_LIST="${TLS_LIST:-shm tcp}"
ROUNDS="${ROUNDS:-3}"
# Puts per perftest run; Ferry's bench gets the same cap (FERRY_BENCH_UCX_MAX_ITERS), so
# its 1 MiB × 1 case times as many requests (each one put).
ITERS="${ITERS:-10000}"
PORT="${PORT:-13337}"
# PIN=1 (default on 2+ CPUs): initiators/clients on CPU 0, targets/servers on CPU 1, for
# both tools alike (`taskset`), so two spinning processes never share a core.
PIN="${PIN:-$([ "$(nproc)" -ge 2 ] && echo 1 || echo 0)}"

bench="${FERRY_BENCH:-}"
if [ -z "$bench" ]; then
  bench="$(cd "$root" && cargo bench -p ferry-benches --bench ucx --no-run 2>&1 \
    | sed -n 's/.*Executable benches\/ucx.rs (\(.*\))/\1/p' | tail -1)"
  [ -n "$bench" ] || { echo "could not build the UCX benchmark" >&2; exit 1; }
  case "$bench" in /*) ;; *) bench="$root/$bench" ;; esac
fi

# The UCX environment of both tools: Ferry's own overrides (state/config.rs), made
# explicit so that perftest gets them too (Ferry sees them set and leaves them alone).
version="$(ucx_info -v | sed -n 's/^# Version \([0-9.]*\).*/\1/p' | head -1)"
common_env="UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n UCX_RNDV_THRESH=inf"
case "$version" in
  1.1[0-3].*|1.[0-9].*) ;;
  *) common_env="$common_env UCX_ZCOPY_THRESH=16k" ;;
esac
env_of() { # tls
  case "$1" in
    shm) echo "$common_env UCX_MM_FIFO_SIZE=256 UCX_MM_SEG_SIZE=32768" ;;
    tcp) echo "$common_env UCX_TLS=tcp" ;;
  esac
}

one_round() { # tls round -> "perftest_overall perftest_median ucx_x1 ucx_x32 own_x1 own_x32"
  local tls="$1" round="$2"
  unshare -n env $(env_of "$tls") bash -s "$tls" "$SIZE" "$ITERS" "$PORT" "$bench" "$PIN" "$round" <<'INNER'
set -euo pipefail
tls="$1"; size="$2"; iters="$3"; port="$4"; bench="$5"; pin="$6"; round="$7"
ip link set lo up
eflag=(); variant=shm
[ "$tls" = tcp ] && { eflag=(-e); variant=tcp; }
on0=(); on1=()
if [ "$pin" = 1 ]; then
  on0=(taskset -c 0); on1=(taskset -c 1); export FERRY_BENCH_UCX_TARGET_CPU=1
fi
run_perftest() {
  "${on1[@]}" ucx_perftest -t ucp_put_bw -s "$size" -n "$iters" -p "$port" "${eflag[@]}" >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  local final
  final="$("${on0[@]}" ucx_perftest 127.0.0.1 -p "$port" -t ucp_put_bw -s "$size" -n "$iters" "${eflag[@]}" 2>&1 | grep '^Final:' || true)"
  wait "$server" || true
  # Final: iters lat50(us) lat_avg lat_overall bw_avg(MiB/s) bw_overall rate_avg rate_overall
  # The median-latency figure only where a put completes in its own call (shm: a memcpy);
  # over tcp the latency of a non-blocking put is the time to queue it.
  perf="$(echo "$final" | awk -v s="$size" -v t="$tls" '{
    printf "%.2f %s", $7 * 1.048576 / 1000, (t == "shm") ? sprintf("%.2f", s / $3 / 1000) : "nan" }')"
  [ -n "$perf" ] || perf="nan nan"
}
ferry() { # alloc -> "GB/s at ×1, GB/s at ×32"
  FERRY_BENCH_UCX_ALLOC="$1" FERRY_BENCH_UCX_VARIANT="$variant" FERRY_BENCH_UCX_BLOCKS="$size" \
    FERRY_BENCH_UCX_BATCHES=1,32 FERRY_BENCH_UCX_MAX_ITERS="$iters" FERRY_BENCH_UCX_IDLE=0 FERRY_BENCH_UCX_CONTROL=0 "${on0[@]}" "$bench" 2>&1 \
    | awk '$1 == "WRITE" && $7 == "contiguous" {
        for (i = 1; i < NF; i++) if ($(i + 1) == "GB/s") bw[$6] = $i }
      END { printf "%s %s", (1 in bw) ? bw[1] : "nan", (32 in bw) ? bw[32] : "nan" }'
}
# The order alternates between rounds (odd: perftest first; even: Ferry first), so
# whatever drifts during a round (page cache, a neighbour's load) hits both tools alike.
if [ $((round % 2)) = 1 ]; then
  run_perftest; own_ucx="$(ferry ucx)"; own_caller="$(ferry caller)"
else
  own_caller="$(ferry caller)"; own_ucx="$(ferry ucx)"; run_perftest
fi
echo "$perf $own_ucx $own_caller"
INNER
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "UCX $version (system libucp; ucx_perftest $(command -v ucx_perftest)), $SIZE B puts, $ROUNDS rounds, pinned: $PIN"
for tls in $TLS_LIST; do
  echo "[$tls] environment of both: $(env_of "$tls")"
  rows=()
  for round in $(seq "$ROUNDS"); do
    row="$(one_round "$tls" "$round")"
    echo "[$tls] round $round (GB/s): perftest overall, at median latency; ferry ucx-alloc ×1, ×32; ferry own memory ×1, ×32: $row"
    rows+=("$row")
  done
  col() { printf '%s\n' "${rows[@]}" | awk -v c="$1" '{ print $c }' | median; }
  awk -v t="$tls" -v po="$(col 1)" -v pm="$(col 2)" -v u1="$(col 3)" -v u32="$(col 4)" \
      -v o1="$(col 5)" -v o32="$(col 6)" 'BEGIN {
    # No median-latency figure over tcp (see one_round): those columns say so.
    lat = (pm == "nan") ? "" : 1
    printf "%s: perftest %.2f GB/s overall, %s (medians of rounds)\n", t, po,
      lat ? sprintf("%.2f at median latency", pm) : "no median-latency figure over tcp"
    split("ucx-alloc 1 MiB x 1 |ucx-alloc 1 MiB x 32|own memory 1 MiB x 1 |own memory 1 MiB x 32", name, "|")
    v[1] = u1; v[2] = u32; v[3] = o1; v[4] = o32
    for (i = 1; i <= 4; i++) {
      printf "%s:   ferry %s %6.2f GB/s = %.2fx perftest overall", t, name[i], v[i], v[i] / po
      if (lat) printf ", %.2fx at median latency", v[i] / pm
      printf "\n"
    } }'
done
