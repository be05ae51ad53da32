#!/usr/bin/env bash
# Side-by-side throughput of the Ferry POSIX backend and fio (io_uring engine) on the
# same patterns: READ/WRITE, buffered/O_DIRECT, block size 1 MiB and 64 KiB, batch
# (= queue depth) 1, 32 and 1024, over a scratch file. Each repetition runs fio once and
# Ferry once, interleaved, the order alternating (odd repetitions fio first, even ones
# Ferry first), so drift of a shared machine hits both alike; medians are printed in
# GB/s (10^9 bytes/s). Ferry's side goes through an Agent by default (benches'
# posix_agent example: one request per batch, every I/O one block as fio's);
# --driver backend drives the POSIX backend directly (posix_bench) instead.
#
# Usage: backends/posix/bench/fio-compare.sh [--size-mib N] [--reps N] [--file PATH]
#                                            [--engine uring|threads] [--driver agent|backend]
# Defaults: 1024 MiB, 3 repetitions, /tmp/ferry-posix-bench.bin, engine uring, driver agent;
# BATCHES="1 32" (environment) runs only those batch sizes.
# Needs: fio (Debian package `fio`; installed here when missing and running as root).
set -euo pipefail

size_mib=1024
reps=3
file=/tmp/ferry-posix-bench.bin
engine=uring
driver=agent
while [ $# -gt 0 ]; do
  case "$1" in
    --size-mib) size_mib=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --file) file=$2; shift 2 ;;
    --engine) engine=$2; shift 2 ;;
    --driver) driver=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

if ! command -v fio >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && apt-get install -y -qq fio >/dev/null
  else
    echo "fio not found: install the Debian package 'fio'" >&2
    exit 1
  fi
fi

root=$(cd "$(dirname "$0")/../../.." && pwd)
case "$driver" in
  agent) pkg=ferry-benches; example=posix_agent ;;
  backend) pkg=ferry-posix; example=posix_bench ;;
  *) echo "--driver: agent or backend, not '$driver'" >&2; exit 2 ;;
esac
cargo build --quiet --release -p "$pkg" --example "$example" --manifest-path "$root/Cargo.toml"
bench="${CARGO_TARGET_DIR:-$root/target}/release/examples/$example"

need_mib=$((size_mib + 64))
avail_mib=$(df -Pm "$(dirname "$file")" | awk 'NR==2 {print $4}')
if [ "$avail_mib" -lt "$need_mib" ]; then
  echo "not enough space in $(dirname "$file"): ${avail_mib} MiB free, need ${need_mib}" >&2
  exit 1
fi

median() { sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }

echo "# $(date -u +%FT%TZ) $(uname -r) $(nproc) cores; file $file ($(df -PT "$(dirname "$file")" | awk 'NR==2 {print $2}')), ${size_mib} MiB per run, ${reps} reps, medians in GB/s"
echo "# order alternates: odd reps fio then ferry, even reps ferry then fio"
echo "# fio $(fio --version): --ioengine=io_uring --fixedbufs=1 --registerfiles=1 --iodepth=<batch> (invalidate=1 default; file fsynced before each run)"
echo "# ferry ($driver: $example): engine=$engine, queue_depth=batch, fixed buffers + fixed files, memory 2 MiB-aligned with 4 KiB pages (--no-huge-pages: fio's buffers are plain malloc'd pages too), page cache dropped before each rep"
printf "%-6s %-9s %-9s %-6s %10s %10s %7s\n" op mode bs batch ferry fio ratio
for bs_kib in 1024 64; do
  for op in write read; do
    for mode in buffered direct; do
      for batch in ${BATCHES:-1 32 1024}; do
        direct_flag=""; direct_fio=0
        if [ "$mode" = direct ]; then direct_flag="--direct"; direct_fio=1; fi
        ferry_runs=(); fio_runs=()
        run_fio() {
          kib=$(fio --name=cmp --filename="$file" --size="${size_mib}M" --bs="${bs_kib}k" \
                    --iodepth="$batch" --rw="$op" --direct="$direct_fio" --ioengine=io_uring \
                    --fixedbufs=1 --registerfiles=1 --output-format=terse --terse-version=3 \
                    2>/dev/null | awk -F';' -v op="$op" '{print (op=="read") ? $7 : $48}')
          fio_runs+=("$(awk -v k="$kib" 'BEGIN {printf "%.3f", k*1024/1e9}')")
        }
        run_ferry() {
          line=$("$bench" --file "$file" --size-mib "$size_mib" --block-kib "$bs_kib" \
                    --batch "$batch" --op "$op" $direct_flag --engine "$engine" --no-huge-pages \
                    --reps 1 2>/dev/null)
          ferry_runs+=("$(sed -n 's/.*median_gbps=\([0-9.]*\).*/\1/p' <<<"$line")")
        }
        for rep in $(seq "$reps"); do
          # Flush dirty pages of earlier runs first: fio's invalidate=1 only drops clean
          # ones (Ferry's bench does fsync + fadvise), and leftover dirty pages would
          # throttle fio's writes.
          if [ $((rep % 2)) = 1 ]; then
            sync "$file"; run_fio; sync "$file"; run_ferry
          else
            sync "$file"; run_ferry; sync "$file"; run_fio
          fi
        done
        f=$(printf "%s\n" "${ferry_runs[@]}" | median)
        g=$(printf "%s\n" "${fio_runs[@]}" | median)
        r=$(awk -v a="$f" -v b="$g" 'BEGIN {if (b > 0) printf "%.2f", a/b; else print "-"}')
        printf "%-6s %-9s %-9s %-6s %10s %10s %7s\n" "$op" "$mode" "${bs_kib}KiB" "$batch" "$f" "$g" "$r"
      done
    done
  done
done
