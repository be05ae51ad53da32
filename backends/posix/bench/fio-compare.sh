#!/usr/bin/env bash
# Side-by-side throughput of the Ferry POSIX backend and fio (io_uring engine) on the
# same patterns: READ/WRITE, buffered/O_DIRECT, block size 1 MiB and 64 KiB, batch
# (= queue depth = fio's iodepth) 1, 32 and 1024, over one scratch file (both sides
# use the same file, so the same file system and placement).
#
# Each cell runs three parties per repetition: Ferry, fio "matched" (--fixedbufs=1
# --registerfiles=1: registered buffers and files, as Ferry's POSIX backend uses by
# default) and fio "as shipped" (fio's own io_uring defaults). The order alternates
# (odd repetitions fio-matched, fio-default, Ferry; even ones the reverse), so drift of
# a shared machine hits all alike; medians are printed in GB/s (10^9 bytes/s), with the
# ratio Ferry / fio for both fio rows.
#
# Like for like: the same file and size (every party moves --size-mib per run), the
# same block size, queue depth = batch, O_DIRECT on all parties for direct cells, 4 KiB
# pages on all (fio's buffers are malloc'd; Ferry's are 2 MiB-aligned with
# MADV_NOHUGEPAGE, and THP is madvise-only on the machines measured), the same memory
# footprint (fio reuses iodepth × bs of buffers; Ferry's requests cycle through batch ×
# block with --mem-blocks <batch>; --ferry-mem distinct gives Ferry one memory block
# per file block instead, as a KV offload would), the same page-cache state (flushed
# and dropped before every run: fio's invalidate=1 after a sync, Ferry's fsync +
# POSIX_FADV_DONTNEED) and the same readahead hint (fio's fadvise_hint=1 =
# POSIX_FADV_SEQUENTIAL; Ferry's access_hint=sequential), and the same preparation of
# that memory (fio fills its buffers for write jobs only; a read job's are first touched
# when io_uring pins them: posix_agent likewise writes a WRITE's source and leaves a
# READ's destination to the backend's registration). Ferry's side goes through an
# Agent by default (benches' posix_agent example: one request per batch, every I/O
# one block as fio's); --driver backend drives the POSIX backend directly
# (posix_bench; it has no --mem-blocks, so its memory is distinct).
#
# Usage: backends/posix/bench/fio-compare.sh [--size-mib N] [--reps N] [--file PATH]
#          [--engine uring|threads] [--driver agent|backend] [--ferry-mem fio|distinct]
# Defaults: 1024 MiB, 3 repetitions, /tmp/ferry-posix-bench.bin, engine uring, driver
# agent, Ferry memory = fio's footprint. Environment: BLOCKS="1024 64" (KiB),
# OPS="write read", MODES="buffered direct", BATCHES="1 32 1024" select cells;
# LOCK=/path runs each cell under `flock -x` on that file (so a long sweep holds a
# shared machine's timing lock one cell at a time); the load average is printed with
# every cell.
# Needs: fio (Debian package `fio`; installed here when missing and running as root).
# Manual benchmark only: no test runs it.
set -euo pipefail

size_mib=1024
reps=3
file=/tmp/ferry-posix-bench.bin
engine=uring
driver=agent
ferry_mem=fio
while [ $# -gt 0 ]; do
  case "$1" in
    --size-mib) size_mib=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --file) file=$2; shift 2 ;;
    --engine) engine=$2; shift 2 ;;
    --driver) driver=$2; shift 2 ;;
    --ferry-mem) ferry_mem=$2; shift 2 ;;
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
case "$ferry_mem" in
  fio|distinct) ;;
  *) echo "--ferry-mem: fio or distinct, not '$ferry_mem'" >&2; exit 2 ;;
esac
if [ "$driver" = backend ] && [ "$ferry_mem" = fio ]; then
  echo "note: --driver backend has no --mem-blocks; Ferry's memory is distinct" >&2
  ferry_mem=distinct
fi
cargo build --quiet --release -p "$pkg" --example "$example" --manifest-path "$root/Cargo.toml"
bench="${CARGO_TARGET_DIR:-$root/target}/release/examples/$example"

need_mib=$((size_mib + 64))
avail_mib=$(df -Pm "$(dirname "$file")" | awk 'NR==2 {print $4}')
if [ "$avail_mib" -lt "$need_mib" ]; then
  echo "not enough space in $(dirname "$file"): ${avail_mib} MiB free, need ${need_mib}" >&2
  exit 1
fi

median() { sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }

echo "# $(date -u +%FT%TZ) $(uname -r) $(nproc) cores; file $file ($(df -PT "$(dirname "$file")" | awk 'NR==2 {print $2}')), ${size_mib} MiB per run, ${reps} reps, medians in GB/s; THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo '?')"
echo "# order alternates: odd reps fio-matched, fio-default, ferry; even reps ferry, fio-default, fio-matched"
echo "# fio $(fio --version) (both rows): --ioengine=io_uring --iodepth=<batch> --bs --direct --size=${size_mib}M, invalidate=1 fadvise_hint=1 (defaults; file synced before each run), buffers malloc'd (4 KiB pages), iodepth x bs of them"
echo "#   matched: --fixedbufs=1 --registerfiles=1; default: fio's defaults (no registered buffers/files); neither hipri nor sqthread_poll"
echo "# ferry ($driver: $example): engine=$engine, queue_depth=batch, fixed buffers + fixed files (the backend's defaults), access_hint=sequential, memory 2 MiB-aligned 4 KiB pages (--no-huge-pages), footprint: $( [ "$ferry_mem" = fio ] && echo 'batch x block, reused (as fio)' || echo 'one block per file block'), written before registration for WRITE only (as fio), page cache flushed+dropped before the run"
printf "%-6s %-9s %-8s %-5s %8s %8s %6s %8s %6s  %s\n" op mode bs batch ferry fio-m ratio fio-d ratio load
sync_file() { if [ -e "$file" ]; then sync "$file"; fi; }
cell_lock() { if [ -n "${LOCK:-}" ]; then exec 9>"$LOCK"; flock -x 9; fi; }
cell_unlock() { if [ -n "${LOCK:-}" ]; then flock -u 9; exec 9>&-; fi; }
for bs_kib in ${BLOCKS:-1024 64}; do
  for op in ${OPS:-write read}; do
    for mode in ${MODES:-buffered direct}; do
      for batch in ${BATCHES:-1 32 1024}; do
        direct_flag=""; direct_fio=0
        if [ "$mode" = direct ]; then direct_flag="--direct"; direct_fio=1; fi
        mem_flag=()
        if [ "$ferry_mem" = fio ]; then mem_flag=(--mem-blocks "$batch"); fi
        ferry_runs=(); fiom_runs=(); fiod_runs=()
        fio_gbps() {
          kib=$(fio --name=cmp --filename="$file" --size="${size_mib}M" --bs="${bs_kib}k" \
                    --iodepth="$batch" --rw="$op" --direct="$direct_fio" --ioengine=io_uring \
                    "$@" --output-format=terse --terse-version=3 \
                    2>/dev/null | awk -F';' -v op="$op" '{print (op=="read") ? $7 : $48}')
          awk -v k="$kib" 'BEGIN {printf "%.3f", k*1024/1e9}'
        }
        run_fiom() { sync_file; fiom_runs+=("$(fio_gbps --fixedbufs=1 --registerfiles=1)"); }
        run_fiod() { sync_file; fiod_runs+=("$(fio_gbps)"); }
        run_ferry() {
          sync_file
          line=$("$bench" --file "$file" --size-mib "$size_mib" --block-kib "$bs_kib" \
                    --batch "$batch" --op "$op" $direct_flag --engine "$engine" --no-huge-pages \
                    "${mem_flag[@]}" --reps 1 2>/dev/null)
          ferry_runs+=("$(sed -n 's/.*median_gbps=\([0-9.]*\).*/\1/p' <<<"$line")")
        }
        cell_lock
        load=$(cut -d' ' -f1-3 /proc/loadavg)
        for rep in $(seq "$reps"); do
          # Flush dirty pages of earlier runs first (each run_* syncs): fio's
          # invalidate=1 only drops clean ones (Ferry's bench does fsync + fadvise), and
          # leftover dirty pages would throttle the next party's writes.
          if [ $((rep % 2)) = 1 ]; then
            run_fiom; run_fiod; run_ferry
          else
            run_ferry; run_fiod; run_fiom
          fi
        done
        cell_unlock
        f=$(printf "%s\n" "${ferry_runs[@]}" | median)
        gm=$(printf "%s\n" "${fiom_runs[@]}" | median)
        gd=$(printf "%s\n" "${fiod_runs[@]}" | median)
        rm_=$(awk -v a="$f" -v b="$gm" 'BEGIN {if (b > 0) printf "%.2f", a/b; else print "-"}')
        rd_=$(awk -v a="$f" -v b="$gd" 'BEGIN {if (b > 0) printf "%.2f", a/b; else print "-"}')
        printf "%-6s %-9s %-8s %-5s %8s %8s %6s %8s %6s  %s\n" "$op" "$mode" "${bs_kib}KiB" "$batch" "$f" "$gm" "$rm_" "$gd" "$rd_" "$load"
        if [ -n "${VERBOSE:-}" ]; then
          echo "#   runs ferry ${ferry_runs[*]} | fio-m ${fiom_runs[*]} | fio-d ${fiod_runs[*]}"
        fi
      done
    done
  done
done
