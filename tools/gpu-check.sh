#!/usr/bin/env bash
# Ferry's GPU checks: built on a machine without a GPU, run on one without Rust or network.
#
#   tools/gpu-check.sh pack [OUT.tar.gz]   # here (needs cargo, pip, maturin + ziglang): release
#                                          # binaries, the GPU test binaries, Ferry's Python wheel
#                                          # (VRAM support built in), the CUDA-capable UCX of the
#                                          # libucx-cu12 and libucx-cu13 wheels (pip download into
#                                          # /tmp) and a cufile.json in one tarball; default
#                                          # target/gpu-pack.tar.gz (ignored by git, never commit it)
#   tar xzf gpu-pack.tar.gz -C DIR && DIR/gpu-check.sh run
#                                          # (DIR on a disk file system, not tmpfs: the GDS
#                                          # test files go there, with O_DIRECT where possible)
#                                          # on the GPU machine (CUDA driver, nvidia-cufile or a
#                                          # CUDA install with libcufile): the UCX build that
#                                          # matches the driver's CUDA major (cuDriverGetVersion),
#                                          # every GPU test, a short `ferry bench xfer` VRAM -> VRAM
#                                          # sweep (two processes, --check), the UCX protocol
#                                          # lines of one VRAM transfer between processes
#                                          # (UCX_PROTO_INFO=y), ferry-gpu-check all (VRAM->VRAM
#                                          # between processes, VRAM<->DRAM, VMM memory, GDS
#                                          # FILE<->VRAM with both engines, each beside a plain CUDA
#                                          # copy, byte checks), a Python tensor transfer, and a
#                                          # PASS/FAIL line per step; bounded to 8 minutes. Without
#                                          # a CUDA driver it says so once per step and exits 1.
#
# Environment for `run`: FERRY_CUFILE (a libcufile.so.0 to use instead of the one found),
# FERRY_GPU_DEV (device ordinal, default 0), FERRY_GPU_ITERS (timed passes, default 10),
# CUFILE_ENV_PATH_JSON (kept when set; otherwise the packed cufile.json: compatibility
# mode allowed, cuFile's log in the run's scratch directory).
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
  mkdir -p "$stage/bin" "$stage/tests" "$stage/python"

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

  log "Ferry's Python wheel (release, abi3, VRAM support)"
  local maturin_path=$PATH
  if ! command -v maturin >/dev/null || ! python3 -c 'import ziglang' 2>/dev/null; then
    # maturin and zig (for manylinux_2_28) in a venv of their own, kept between packs.
    local tools_venv=/tmp/ferry-gpu-pack-venv
    [[ -x $tools_venv/bin/maturin ]] ||
      { python3 -m venv "$tools_venv" && "$tools_venv/bin/pip" install -q maturin ziglang; }
    maturin_path=$tools_venv/bin:$PATH
  fi
  (cd engine/python && PATH=$maturin_path maturin build -q --release --zig \
    --compatibility manylinux_2_28 -o "$stage/python")
  cp tools/gpu/python_check.py "$stage/"

  mkdir -p "$wheels"
  local cu
  for cu in cu12 cu13; do
    log "libucx-$cu (pip download into $wheels)"
    if ! ls "$wheels"/libucx_"$cu"-*.whl >/dev/null 2>&1; then
      pip3 download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
        --python-version 3.12 "libucx-$cu" -d "$wheels"
    fi
    local wheel
    wheel=$(ls "$wheels"/libucx_"$cu"-*.whl | sort | tail -n 1)
    # Only the shared libraries UCX loads (no static archives, perftest or tools).
    python3 - "$wheel" "$stage/ucx-$cu" "libucx_$cu.libs/" <<'PY'
import os, sys, zipfile
wheel, dest, libs = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        name = info.filename
        base = os.path.basename(name)
        keep = (name.startswith("libucx/lib/") and base.endswith(".so.0") and "perftest" not in base) \
            or name.startswith(libs)
        if keep:
            z.extract(info, dest)
print("UCX from", os.path.basename(wheel))
PY
  done
  cp tools/gpu/cufile.json "$stage/cufile.json"

  if command -v strip >/dev/null; then
    strip --strip-debug "$stage"/bin/* "$stage"/tests/*
  fi
  cp tools/gpu-check.sh "$stage/"
  git rev-parse HEAD >"$stage/COMMIT" 2>/dev/null || true
  mkdir -p "$(dirname "$out")"
  tar -czf "$out" -C "$stage" .
  log "packed $(du -h "$out" | cut -f1) ($(stat -c %s "$out") bytes) into $out (commit $(cat "$stage/COMMIT" 2>/dev/null))"
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
  # Every step's limit is cut to what is left of this budget, so the run ends within
  # 8 minutes (5 s of kill grace per step included).
  local budget=470

  # step NAME TIMEOUT_S COMMAND...: run it bounded, keep its output, record the verdict.
  step() {
    local name=$1 limit=$2
    shift 2
    local left=$((budget - (SECONDS - started) - 5))
    ((limit > left)) && limit=$left
    log "$name"
    if ((limit <= 0)); then
      results+=("$(printf '%-50s %s' "$name" "FAIL (no time left in the 8-minute budget)")")
      failed=1
      return
    fi
    local t0=$SECONDS rc=0
    if declare -F "$1" >/dev/null; then
      # A function of this script: run it in a bash of its own, so timeout can end it.
      export -f "$1"
      timeout --kill-after=5 "$limit" bash -c "$1" || rc=$?
    else
      timeout --kill-after=5 "$limit" "$@" || rc=$?
    fi
    local verdict=PASS
    if ((rc == 124)); then
      verdict="FAIL (over its ${limit} s limit)"
      failed=1
    elif ((rc != 0)); then
      verdict="FAIL (exit $rc)"
      failed=1
    fi
    results+=("$(printf '%-50s %s (%ss)' "$name" "$verdict" $((SECONDS - t0)))")
  }

  local steps=(
    "ferry backends (here, system libraries)"
    "test ferry-cuda (driver, device, copies, VMM)"
    "test ferry-ucx vram (VRAM<->VRAM, VRAM<->DRAM, VMM)"
    "test ferry-gds gpu (FILE<->VRAM, both engines)"
    "ferry bench xfer VRAM->VRAM (2 processes)"
    "UCX protocols of a VRAM transfer (UCX_PROTO_INFO)"
    "ferry-gpu-check all (bench + byte checks)"
    "python: tensors through ferry (UCX, VRAM)"
  )

  log "machine"
  nvidia-smi -L 2>&1 || true
  nvidia-smi --query-gpu=driver_version,name,memory.total --format=csv,noheader 2>&1 || true
  echo "commit: $(cat COMMIT 2>/dev/null || echo unknown)"
  # The driver decides which UCX build runs: libucx-cu13 needs a CUDA 13 driver.
  local driver rc=0
  driver=$(timeout 60 bin/ferry-gpu-check driver 2>&1) || rc=$?
  echo "CUDA driver: ${driver#ferry-gpu-check: }"
  if ((rc != 0)); then
    log "summary"
    local name
    for name in "${steps[@]}"; do
      printf '%-50s %s\n' "$name" "FAIL (no CUDA driver)"
    done
    echo "gpu-check: FAIL in $((SECONDS - started)) s (no CUDA driver)"
    return 1
  fi
  local major=$(( ${driver%% *} / 1000 ))
  local cu=cu13
  ((major < 13)) && cu=cu12
  local ucp=$PWD/ucx-$cu/libucx/lib/libucp.so.0
  echo "UCX: $ucp (the driver supports CUDA $major)"

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
  echo "cuFile: ${cufile:-not found}"
  # The pip wheel of cuFile ships no cufile.json: use ours (compatibility mode allowed,
  # the log in the scratch directory) unless the user named one.
  if [[ -z ${CUFILE_ENV_PATH_JSON:-} ]]; then
    sed "s|@LOG_DIR@|$scratch|" cufile.json >"$scratch/cufile.json"
    export CUFILE_ENV_PATH_JSON=$scratch/cufile.json
  fi
  echo "cufile.json: $CUFILE_ENV_PATH_JSON"
  if [[ -e /proc/driver/nvidia-fs/version ]]; then
    echo "nvidia-fs: $(head -n 1 /proc/driver/nvidia-fs/version)"
  else
    echo "nvidia-fs: not loaded (cuFile runs in compatibility mode)"
  fi

  export FERRY_TEST_GPU=1
  export FERRY_UCX_LIBRARY=$ucp
  export FERRY_TEST_CUFILE=$cufile
  export FERRY_TEST_GDS_DIR=$scratch
  export UCX_WARN_UNUSED_ENV_VARS=n
  export RUST_BACKTRACE=1
  local dev=${FERRY_GPU_DEV:-0}
  local iters=${FERRY_GPU_ITERS:-10}
  # What the steps that are functions (run in a bash of their own) need.
  export GPU_DEV=$dev GPU_UCP=$ucp GPU_SCRATCH=$scratch GPU_ITERS=$iters

  step "${steps[0]}" 15 bin/ferry backends
  step "${steps[1]}" 30 tests/ferry-cuda-ferry_cuda --test-threads=1
  step "${steps[2]}" 60 tests/ferry-ucx-vram --test-threads=1 --nocapture
  step "${steps[3]}" 60 tests/ferry-gds-gpu --test-threads=1 --nocapture
  # 64 KiB and 1 MiB blocks x 1 and 32, READ and WRITE, every byte checked (host copies).
  step "${steps[4]}" 35 \
    bin/ferry bench xfer --backend ucx --initiator-mem vram --target-mem vram --dev "$dev" \
    --ucx-library "$ucp" --op write,read --start-block 64K --max-block 1M --block-factor 16 \
    --max-batch 32 --batch-factor 32 --iters "$iters" --warmup 2 --check
  # Which protocol UCX picks for GPU memory between processes (cuda_ipc expected;
  # error_handling=peer could push it elsewhere): its selection tables, then the lines
  # that name a CUDA transport.
  proto() {
    local rc=0
    UCX_PROTO_INFO=y bin/ferry-gpu-check all --only ipc --dev "$GPU_DEV" --ucx-library "$GPU_UCP" \
      --dir "$GPU_SCRATCH" --iters 2 >"$GPU_SCRATCH/proto.log" 2>&1 || rc=$?
    grep -E '^\[|\|' "$GPU_SCRATCH/proto.log" | grep -iE 'cuda|rendezvous|zero-copy|copy-in' | head -n 40
    if grep -q cuda_ipc "$GPU_SCRATCH/proto.log"; then
      echo "UCX chose cuda_ipc for VRAM between processes"
    else
      echo "UCX did NOT name cuda_ipc for VRAM between processes (see the tables above)"
    fi
    tail -n 5 "$GPU_SCRATCH/proto.log"
    return $rc
  }
  step "${steps[5]}" 45 proto
  step "${steps[6]}" 180 \
    bin/ferry-gpu-check all --dev "$dev" --ucx-library "$ucp" ${cufile:+--cufile-library "$cufile"} \
    --dir "$scratch" --iters "$iters"
  python_step() {
    command -v python3 >/dev/null || { echo "no python3 on this machine"; return 1; }
    python3 -c 'import numpy' 2>/dev/null ||
      { echo "python3 has no numpy (the ferry package depends on it; no network to install it)"; return 1; }
    local wheel
    wheel=$(ls python/ferry-*.whl | head -n 1)
    # A wheel is a zip: unpacked onto PYTHONPATH, no pip and no network needed.
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
      "$wheel" "$GPU_SCRATCH/py"
    PYTHONPATH="$GPU_SCRATCH/py" python3 python_check.py --ucx-library "$GPU_UCP" \
      --dev "$GPU_DEV" --iters "$GPU_ITERS"
  }
  step "${steps[7]}" 40 python_step

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
    sed -n '2,28p' "$0" >&2
    exit 2
    ;;
esac
