#!/usr/bin/env bash
# Raw-UCX baseline for the Ferry UCX benchmark: ucx_perftest (Debian ucx-utils) put/get
# bandwidth and message rate for the same message sizes and transports.
#
# ucx_perftest's server listens on every address, so server and client run inside a
# private network namespace (`unshare -n`) where only `lo` is up. Needs root (or user
# namespaces) and ucx-utils.
#
#   backends/ucx/bench/perftest-compare.sh            # default transports and tcp
#   TLS_LIST="tcp" SIZES="1048576" backends/ucx/bench/perftest-compare.sh
#
# Then run Ferry's side:  cargo bench -p ferry-benches --bench ucx
set -euo pipefail
command -v ucx_perftest >/dev/null || { echo "missing ucx_perftest: apt-get install ucx-utils" >&2; exit 1; }
SIZES="${SIZES:-4096 65536 1048576 16777216}"
TLS_LIST="${TLS_LIST:-default tcp}"
TESTS="${TESTS:-ucp_put_bw}"
ITERS="${ITERS:-2000}"

run_one() { # tls test size
  local tls="$1" test="$2" size="$3" iters="$ITERS"
  [ "$size" -ge 16777216 ] && iters=$(( ITERS / 10 > 50 ? ITERS / 10 : 50 ))
  unshare -n bash -s "$tls" "$test" "$size" "$iters" <<'INNER'
set -euo pipefail
tls="$1"; test="$2"; size="$3"; iters="$4"
ip link set lo up
export UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
[ "$tls" != default ] && export UCX_TLS="$tls"
ucx_perftest -t "$test" -s "$size" -n "$iters" -p 13337 >/dev/null 2>&1 &
server=$!
sleep 0.5
out="$(ucx_perftest 127.0.0.1 -p 13337 -t "$test" -s "$size" -n "$iters" 2>&1 | grep '^Final:' || true)"
wait "$server" || true
# Final: iters  lat50  lat_avg  lat_overall  bw_avg(MB/s)  bw_overall(MB/s)  rate_avg  rate_overall
echo "$out" | awk -v t="$tls" -v n="$test" -v s="$size" \
  '{ printf "%-8s %-11s %9d B  bw %8.2f GB/s  rate %9.0f msg/s\n", t, n, s, $6 * 1.048576 / 1000, $8 }'
INNER
}

echo "ucx_perftest of $(ucx_info -v | head -1 | sed "s/^# //")"
for tls in $TLS_LIST; do
  for test in $TESTS; do
    for size in $SIZES; do
      run_one "$tls" "$test" "$size"
    done
  done
done
