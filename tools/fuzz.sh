#!/usr/bin/env bash
# Run one of Ferry's cargo-fuzz targets (metadata/fuzz) for a given time and report
# what it did: executions, corpus size, coverage, findings.
#
#   tools/fuzz.sh                              # list the targets
#   tools/fuzz.sh <target> [seconds]           # fuzz <target> for [seconds] (default 60)
#   tools/fuzz.sh <target> [seconds] -- ARGS   # extra libFuzzer flags (e.g. -max_len=65536)
#
# Inputs: the committed seeds in metadata/fuzz/seeds/<target>/ (read, never written)
# plus the persistent corpus in metadata/fuzz/corpus/<target>/ (git-ignored; libFuzzer
# adds every input that reached new code, so each run starts where the last stopped).
# Findings go to metadata/fuzz/artifacts/<target>/; the full libFuzzer log of the last
# run to metadata/fuzz/logs/<target>.log. Exit status 1 when the run found something.
#
# Environment: FERRY_FUZZ_SANITIZER=address|none (default address; `none` runs the
# safe-Rust parsers about twice as fast), FERRY_FUZZ_VERBOSE=1 streams libFuzzer's
# output instead of only the summary.
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz --locked`).
set -euo pipefail
cd "$(dirname "$0")/.."
fuzz_dir=metadata/fuzz

targets() {
  # Every [[bin]] of the fuzz crate is a target.
  awk '/^\[\[bin\]\]/ { bin = 1; next } bin && /^name *=/ { gsub(/[" ]/, "", $0); sub(/name=/, ""); print; bin = 0 }' \
    "$fuzz_dir/Cargo.toml"
}

count_files() {
  if [[ -d $1 ]]; then find "$1" -type f | wc -l; else echo 0; fi
}

if (($# == 0)); then
  echo "fuzz targets (tools/fuzz.sh <target> [seconds]):"
  for t in $(targets); do
    seeds=$(count_files "$fuzz_dir/seeds/$t")
    corpus=$(count_files "$fuzz_dir/corpus/$t")
    printf '  %-20s %4d seeds, %6d corpus inputs\n' "$t" "$seeds" "$corpus"
  done
  exit 0
fi

target=$1
seconds=${2:-60}
shift $(($# >= 2 ? 2 : 1))
if (($# > 0)) && [[ $1 == -- ]]; then shift; fi
extra=("$@")

if ! targets | grep -qx "$target"; then
  echo "unknown fuzz target '$target'; known: $(targets | tr '\n' ' ')" >&2
  exit 2
fi
if ! [[ $seconds =~ ^[0-9]+$ ]] || ((seconds == 0)); then
  echo "seconds must be a positive whole number, got '$seconds'" >&2
  exit 2
fi
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "the nightly toolchain is missing: rustup toolchain install nightly" >&2
  exit 2
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "cargo-fuzz is missing: cargo install cargo-fuzz --locked" >&2
  exit 2
fi

corpus=$fuzz_dir/corpus/$target
seeds=$fuzz_dir/seeds/$target
artifacts=$fuzz_dir/artifacts/$target
logs=$fuzz_dir/logs
mkdir -p "$corpus" "$artifacts" "$logs"
log=$logs/$target.log
corpus_dirs=("$corpus")
[[ -d $seeds ]] && corpus_dirs+=("$seeds")

before=$(mktemp)
trap 'rm -f "$before"' EXIT
ls -1 "$artifacts" | sort >"$before"
corpus_before=$(count_files "$corpus")

sanitizer=${FERRY_FUZZ_SANITIZER:-address}
echo "== building $target (sanitizer: $sanitizer)"
cargo +nightly fuzz build --fuzz-dir "$fuzz_dir" -s "$sanitizer" "$target" 2>&1 | tail -n 3

echo "== fuzzing $target for ${seconds}s (seeds: $seeds, corpus: $corpus)"
status=0
run=(cargo +nightly fuzz run --fuzz-dir "$fuzz_dir" -s "$sanitizer" "$target" "${corpus_dirs[@]}" --
  -max_total_time="$seconds" -timeout=10 -print_final_stats=1
  -artifact_prefix="$artifacts/" "${extra[@]}")
if [[ -n ${FERRY_FUZZ_VERBOSE:-} ]]; then
  "${run[@]}" 2>&1 | tee "$log" || status=$?
else
  "${run[@]}" >"$log" 2>&1 || status=$?
fi

stat() { sed -n "s/^stat::$1: *//p" "$log" | tail -n 1; }
last_status=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
new_findings=$(comm -13 "$before" <(ls -1 "$artifacts" | sort))
echo "== $target: ${seconds}s"
echo "executions:     $(stat number_of_executed_units) ($(stat average_exec_per_sec)/s)"
echo "peak RSS:       $(stat peak_rss_mb) MB"
echo "corpus:         $(count_files "$corpus") inputs ($corpus_before before this run)"
echo "last status:    ${last_status:-none}"
echo "log:            $log"
if [[ -n $new_findings ]]; then
  echo "FINDINGS in $artifacts:"
  for f in $new_findings; do echo "  $f"; done
  grep -E -m 5 'panicked at|ERROR: (libFuzzer|AddressSanitizer)|SUMMARY' "$log" | sed 's/^/  /' || true
  echo "replay: cargo +nightly fuzz run --fuzz-dir $fuzz_dir $target $artifacts/<file>"
  echo "then add the input to $seeds/ (the stable property tests replay every seed)."
  exit 1
fi
if ((status != 0)); then
  echo "libFuzzer exited with status $status and no artifact; see $log" >&2
  tail -n 20 "$log" >&2
  exit "$status"
fi
echo "findings:       none"
