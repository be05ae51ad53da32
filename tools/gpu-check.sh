#!/usr/bin/env bash
# Ferry's GPU checks: built on a machine without a GPU, run on one without Rust or network.
#
#   tools/gpu-check.sh pack [OUT.tar.gz]   # here (needs cargo, pip): release binaries, the GPU
#                                          # test binaries and the CUDA-capable UCX of the
#                                          # libucx-cu13 wheel (pip download into /tmp) in one
#                                          # tarball; default target/gpu-pack.tar.gz (ignored
#                                          # by git, never commit it)
#   tar xzf gpu-pack.tar.gz -C DIR && DIR/gpu-check.sh run
#                                          # (DIR on a disk file system, not tmpfs: the GDS
#                                          # test files go there, with O_DIRECT where possible)
#                                          # on the GPU machine (CUDA driver, nvidia-cufile or a
#                                          # CUDA install with libcufile): every GPU test, a short
#                                          # `ferry bench xfer` VRAM -> VRAM sweep (two processes,
#                                          # --check), then ferry-gpu-check all (VRAM->VRAM between
#                                          # processes, VRAM<->DRAM, GDS FILE<->VRAM, each at 1 MiB
#                                          # x 32 and 64 KiB x 1024 beside a plain CUDA copy, byte
#                                          # checks), a PASS/FAIL summary; bounded to 8 minutes.
#
# Environment for `run`: FERRY_CUFILE (a libcufile.so.0 to use instead of the one found),
# FERRY_GPU_DEV (device ordinal, default 0), FERRY_GPU_ITERS (timed passes, default 10).
set -euo pipefail

log() { printf '\n== %s\n' "$*"; }

pack() {
  cd "$(dirname "$0")/.."
  local out=${1:-target/gpu-pack.tar.gz}
  local wheels=/tmp/ferry-gpu-wheels
  local stage
  stage=$(mktemp -d /tmp/ferry-gpu-pack.XXXXXX)
  # shellcheck disable=SC2064 # expand now: the variable is local
  trap "rm -rf '$stage'" RETURN
  mkdir -p "$stage/bin" "$stage/tests" "$stage/ucx"

  log "release binaries (GPU code compiled in: ferry-tools' cuda feature, ferry/cuda)"
  cargo build -q --release -p ferry-gpu --bin ferry-gpu-check
  cargo build -q --release -p ferry-tools --features cuda --bin ferry
  cp target/release/ferry-gpu-check target/release/ferry "$stage/bin/"

  log "GPU test binaries"
  cargo test -q --release --no-run -p ferry-cuda -p ferry-ucx -p ferry-gds \
    --features ferry-ucx/cuda,ferry-gds/cuda --message-format=json 2>/dev/null |
    python3 -c '
import json, shutil, sys
# (package, target) pairs whose tests need a GPU; the rest of the workspace tests run in CI.
wanted = {("ferry-cuda", "ferry_cuda"), ("ferry-ucx", "vram"), ("ferry-gds", "gpu")}
found = set()
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    pkg = msg["package_id"].split("#")[0].rsplit("/", 1)[-1].split("@")[0]
    name = msg["target"]["name"]
    for p, t in wanted:
        if name == t and (p in msg["package_id"] or pkg == p):
            shutil.copy(msg["executable"], sys.argv[1] + "/" + p + "-" + t)
            found.add((p, t))
missing = wanted - found
if missing:
    sys.exit("gpu-check pack: test binaries not found: %s" % sorted(missing))
' "$stage/tests"

  log "libucx-cu13 (pip download into $wheels)"
  mkdir -p "$wheels"
  if ! ls "$wheels"/libucx_cu13-*.whl >/dev/null 2>&1; then
    pip3 download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --python-version 3.12 libucx-cu13 -d "$wheels"
  fi
  local wheel
  wheel=$(ls "$wheels"/libucx_cu13-*.whl | sort | tail -n 1)
  # Only the shared libraries UCX loads (no static archives, perftest or tools).
  python3 - "$wheel" "$stage/ucx" <<'PY'
import os, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        name = info.filename
        base = os.path.basename(name)
        keep = (name.startswith("libucx/lib/") and base.endswith(".so.0") and "perftest" not in base) \
            or name.startswith("libucx_cu13.libs/")
        if keep:
            z.extract(info, dest)
print("UCX from", os.path.basename(wheel))
PY

  if command -v strip >/dev/null; then
    strip --strip-debug "$stage"/bin/* "$stage"/tests/*
  fi
  cp tools/gpu-check.sh "$stage/"
  git rev-parse HEAD >"$stage/COMMIT" 2>/dev/null || true
  mkdir -p "$(dirname "$out")"
  tar -czf "$out" -C "$stage" .
  log "packed $(du -h "$out" | cut -f1) into $out (commit $(cat "$stage/COMMIT" 2>/dev/null))"
}

run() {
  cd "$(dirname "$0")"
  local started=$SECONDS
  local results=()
  local failed=0
  local scratch
  scratch=$(mktemp -d "$PWD/scratch.XXXXXX")
  # shellcheck disable=SC2064 # expand now: the variable is local
  trap "rm -rf '$scratch'" EXIT

  # step NAME TIMEOUT_S COMMAND...: run it bounded, keep its output, record the verdict.
  step() {
    local name=$1 limit=$2
    shift 2
    log "$name"
    local t0=$SECONDS rc=0
    timeout --kill-after=5 "$limit" "$@" || rc=$?
    local verdict=PASS
    if ((rc == 124)); then
      verdict="FAIL (over its ${limit} s limit)"
      failed=1
    elif ((rc != 0)); then
      verdict="FAIL (exit $rc)"
      failed=1
    fi
    results+=("$(printf '%-44s %s (%ss)' "$name" "$verdict" $((SECONDS - t0)))")
  }

  local ucp=$PWD/ucx/libucx/lib/libucp.so.0
  local cufile=${FERRY_CUFILE:-}
  if [[ -z $cufile ]]; then
    cufile=$( (ldconfig -p 2>/dev/null | awk '/libcufile\.so\.0 /{print $NF; exit}') || true)
  fi
  if [[ -z $cufile ]]; then
    cufile=$(python3 - <<'PY' 2>/dev/null || true
import glob, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
for root in roots:
    hits = sorted(glob.glob(root + "/**/libcufile.so.0", recursive=True))
    if hits:
        print(hits[0]); sys.exit(0)
PY
)
  fi

  log "machine"
  nvidia-smi -L 2>&1 || true
  nvidia-smi --query-gpu=driver_version,name,memory.total --format=csv,noheader 2>&1 || true
  echo "UCX: $ucp"
  echo "cuFile: ${cufile:-not found}"
  if [[ -e /proc/driver/nvidia-fs/version ]]; then
    echo "nvidia-fs: $(head -n 1 /proc/driver/nvidia-fs/version)"
  else
    echo "nvidia-fs: not loaded (cuFile runs in compatibility mode)"
  fi
  echo "commit: $(cat COMMIT 2>/dev/null || echo unknown)"

  export FERRY_TEST_GPU=1
  export FERRY_UCX_LIBRARY=$ucp
  export FERRY_TEST_CUFILE=$cufile
  export FERRY_TEST_GDS_DIR=$scratch
  export UCX_WARN_UNUSED_ENV_VARS=n
  export RUST_BACKTRACE=1
  local dev=${FERRY_GPU_DEV:-0}
  local iters=${FERRY_GPU_ITERS:-10}

  step "ferry backends (here, system libraries)" 15 bin/ferry backends
  step "test ferry-cuda (driver, device, copies)" 30 tests/ferry-cuda-ferry_cuda --test-threads=1
  step "test ferry-ucx vram (VRAM<->VRAM, VRAM<->DRAM)" 75 tests/ferry-ucx-vram --test-threads=1 --nocapture
  step "test ferry-gds gpu (FILE<->VRAM, both engines)" 75 tests/ferry-gds-gpu --test-threads=1 --nocapture
  # 64 KiB and 1 MiB blocks x 1 and 32, READ and WRITE, every byte checked (host copies).
  step "ferry bench xfer VRAM->VRAM (2 processes)" 35 \
    bin/ferry bench xfer --backend ucx --initiator-mem vram --target-mem vram --dev "$dev" \
    --ucx-library "$ucp" --op write,read --start-block 64K --max-block 1M --block-factor 16 \
    --max-batch 32 --batch-factor 32 --iters "$iters" --warmup 2 --check
  # Step limits add up to 450 s (+5 s kill grace each): the run ends within 8 minutes.
  step "ferry-gpu-check all (bench + byte checks)" 220 \
    bin/ferry-gpu-check all --dev "$dev" --ucx-library "$ucp" ${cufile:+--cufile-library "$cufile"} \
    --dir "$scratch" --iters "$iters"

  log "summary"
  printf '%s\n' "${results[@]}"
  local verdict=PASS
  ((failed == 0)) || verdict=FAIL
  echo "gpu-check: $verdict in $((SECONDS - started)) s"
  return "$failed"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *)
    sed -n '2,21p' "$0" >&2
    exit 2
    ;;
esac
