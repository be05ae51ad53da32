#!/usr/bin/env bash
# Ferry's OBJ backend against NIXL 1.5.1's OBJ plugin, same S3 server, same run:
# PUT and GET of 1 MiB x 32 objects and 64 MiB x 1 object, ROUNDS interleaved rounds
# (default 3), the order of the two sides alternated each round, medians printed.
#
#   backends/obj/bench/nixl-compare.sh                # starts a moto server on 127.0.0.1
#   S3_ENDPOINT=http://127.0.0.1:9000 S3_BUCKET=b backends/obj/bench/nixl-compare.sh
#
# Needs: a release `ferry` built with `--features obj` (FERRY_BIN, default
# target/release/ferry), python3 with venv. Installs into throwaway venvs under /tmp:
# nixl-cu12==1.5.1 + numpy (NIXL_VENV, as backends/ucx/bench/nixl-venv.sh) and, when no
# endpoint is given, moto[server] + boto3 (MOTO_VENV). Two configurations:
#   defaults: both sides as shipped (Ferry: max_in_flight 64, multipart uploads from
#             32 MiB and ranged GETs, both in 16 MiB parts; NIXL: its standard S3 client,
#             num_threads = hardware threads / 2, one request per object);
#   matched:  one HTTP request per object and 32 at a time on both sides, and no
#             SHA-256 of the body on either (Ferry: max_in_flight=32, part_bytes and
#             multipart_threshold_bytes 128 MiB, unsigned_payload=true; NIXL:
#             num_threads=32; its AWS SDK C++ sends STREAMING-UNSIGNED-PAYLOAD-TRAILER
#             with a CRC64NVME trailer over http, as its PUT headers show);
#   multipart: objects from 16 MiB in 16 MiB parts side by side on both sides (Ferry:
#             part_bytes and multipart_threshold_bytes 16 MiB, unsigned_payload=true as
#             the CRT sends UNSIGNED-PAYLOAD over http too; NIXL: crtMinLimit=16777216,
#             its S3 CRT client for objects from 16 MiB, which cuts 64 MiB into four
#             16 MiB parts for both PUT and GET, as the server's log shows).
# A side whose request fails (NIXL reports NIXL_ERR_BACKEND) shows "failed" in its cell
# and is not run again in later rounds (NIXL's standard client retries a failing 64 MiB
# PUT for about two minutes before it gives up).
set -euo pipefail
cd "$(dirname "$0")/../../.."
rounds=${ROUNDS:-3}
iters=${ITERS:-5}
warmup=${WARMUP:-1}
ferry_bin=${FERRY_BIN:-${CARGO_TARGET_DIR:-target}/release/ferry}
[ -x "$ferry_bin" ] || { echo "no $ferry_bin: cargo build --release -p ferry-tools --features obj" >&2; exit 1; }
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-testing} AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-testing}
export AWS_REGION=${AWS_REGION:-us-east-1}

# NIXL's venv (the same as the UCX comparison's).
# shellcheck source=/dev/null
source backends/ucx/bench/nixl-venv.sh
nixl_py="$venv/bin/python"

moto_pid=
cleanup() { [ -n "$moto_pid" ] && kill "$moto_pid" 2>/dev/null || true; }
trap cleanup EXIT
endpoint=${S3_ENDPOINT:-}
bucket=${S3_BUCKET:-ferry-compare}
if [ -z "$endpoint" ]; then
  mvenv=${MOTO_VENV:-/tmp/ferry-moto-venv}
  [ -x "$mvenv/bin/moto_server" ] || { python3 -m venv "$mvenv" && "$mvenv/bin/pip" install -q 'moto[server]' boto3; }
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  "$mvenv/bin/moto_server" -H 127.0.0.1 -p "$port" >/tmp/ferry-obj-compare-moto.log 2>&1 &
  moto_pid=$!
  endpoint="http://127.0.0.1:$port"
  for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
  echo "moto $("$mvenv/bin/pip" show moto 2>/dev/null | sed -n 's/^Version: //p') at $endpoint" >&2
fi
curl -s -X PUT "$endpoint/$bucket" >/dev/null || true

out=$(mktemp -d -t ferry-obj-compare.XXXXXX)
ferry_run() { # config block count -> "OP GBps" lines
  local config=$1 block=$2 count=$3 extra=()
  [ "$config" = matched ] && extra=(--param max_in_flight=32 --param part_bytes=134217728 --param multipart_threshold_bytes=134217728 --param unsigned_payload=true)
  [ "$config" = multipart ] && extra=(--param part_bytes=16777216 --param multipart_threshold_bytes=16777216 --param unsigned_payload=true)
  "$ferry_bin" bench xfer --backend obj --endpoint "$endpoint" --bucket "$bucket" \
    --op write,read --start-block "$block" --max-block "$block" \
    --start-batch "$count" --max-batch "$count" --iters "$iters" --warmup "$warmup" \
    --run-id "ferry-$config" "${extra[@]}" --jsonl "$out/ferry.jsonl" >/dev/null
  python3 - "$out/ferry.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["op"].upper(), r["gbps"])
EOF
  rm -f "$out/ferry.jsonl"
}
nixl_run() { # config block count
  local extra=() lines
  [ "$1" = matched ] && extra=(--param num_threads=32)
  [ "$1" = multipart ] && extra=(--param crtMinLimit=16777216)
  lines=$("$nixl_py" backends/obj/bench/nixl_obj.py --endpoint "$endpoint" --bucket "$bucket" \
    --block "$2" --count "$3" --iters "$iters" --warmup "$warmup" --prefix "nixl-$1" "${extra[@]}" \
    2>"$out/nixl.err" | sed -n 's/^nixl \([A-Z]*\) .*GB\/s \([0-9.]*\).*/\1 \2/p') || true
  [ -n "$lines" ] && echo "$lines"
  # An op that printed nothing failed (WRITE first: a failed WRITE leaves READ unrun).
  for op in WRITE READ; do
    grep -q "^$op " <<<"$lines" || { echo "$op failed"; tail -1 "$out/nixl.err" >&2; }
  done
}

# Before each side's run, wait until the server has been idle for half a second (its
# CPU time, where this script started it; else 2 s): a failed side can leave the server
# busy for seconds with the rest of its bodies (seen after NIXL's failing 64 MiB PUT:
# moto served 8 requests a second for 11 s), which would be charged to whoever runs next.
settle() {
  if [ -z "$moto_pid" ]; then sleep 2; return; fi
  local before after
  for _ in $(seq 120); do
    before=$(awk '{print $14 + $15}' "/proc/$moto_pid/stat" 2>/dev/null || echo 0)
    sleep 0.5
    after=$(awk '{print $14 + $15}' "/proc/$moto_pid/stat" 2>/dev/null || echo 0)
    (( after - before <= 2 )) && return
  done
}

declare -A samples
for round in $(seq "$rounds"); do
  for config in defaults matched multipart; do
    for shape in "1048576 32" "67108864 1"; do
      read -r block count <<<"$shape"
      if ((round % 2)); then order="ferry nixl"; else order="nixl ferry"; fi
      for side in $order; do
        [[ "${samples[$config|$block|$count|WRITE|$side]:-}" == *failed* ]] && continue
        settle
        while read -r op gbps; do
          key="$config|$block|$count|$op|$side"
          samples[$key]="${samples[$key]:-} $gbps"
          echo "round $round $side $config ${block}x$count $op: $gbps GB/s" >&2
        done < <("${side}_run" "$config" "$block" "$count")
      done
    done
  done
done

echo "load average: $(cut -d' ' -f1-3 /proc/loadavg); endpoint $endpoint; $rounds rounds, $iters iters (+$warmup warm-up) each"
printf '| config | objects | op | Ferry GB/s | NIXL GB/s | Ferry / NIXL (medians) | per-round ratios (median) |\n|---|---|---|---|---|---|---|\n'
median() { # "failed" when any sample is
  local all; all=$(cat)
  if [[ "$all" == *failed* ]]; then echo failed; return; fi
  tr ' ' '\n' <<<"$all" | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {printf "%.3f\n", v[int((NR+1)/2)]}'
}
for config in defaults matched multipart; do
  for shape in "1048576 32" "67108864 1"; do
    read -r block count <<<"$shape"
    for op in WRITE READ; do
      f=$(echo "${samples[$config|$block|$count|$op|ferry]:-}" | median)
      n=$(echo "${samples[$config|$block|$count|$op|nixl]:-}" | median)
      ratio=$(python3 -c "print(f'{$f/$n:.2f}x')" 2>/dev/null || echo -)
      # Round k's Ferry sample over round k's NIXL sample, and their median.
      per_round=$(python3 -c '
import statistics, sys
f, n = (a.split() for a in sys.argv[1:3])
r = [float(x) / float(y) for x, y in zip(f, n)]
print(", ".join(f"{x:.2f}" for x in r) + f" ({statistics.median(r):.2f}x)")
' "${samples[$config|$block|$count|$op|ferry]:-}" "${samples[$config|$block|$count|$op|nixl]:-}" 2>/dev/null || echo -)
      printf '| %s | %s MiB x %s | %s | %s | %s | %s | %s |\n' "$config" $((block >> 20)) "$count" "$op" "$f" "$n" "$ratio" "$per_round"
    done
  done
done
rm -rf "$out"
