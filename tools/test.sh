#!/usr/bin/env bash
# Ferry's one test command: installs what is missing (Debian packages, when run as
# root), starts the services the tests use on 127.0.0.1, runs every test, stops them.
#
#   tools/test.sh            # everything
#   FERRY_TEST_QUICK=1 tools/test.sh   # skip the release-mode demo smoke run
#
# Tests that need a component (UCX, etcd, io_uring …) fail when CI=true and the
# component is missing, and print why they skip otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

# A run from a fresh clone needs ~5 GB for target/ and ~6.5 GB of venvs under TMPDIR
# (README): say up front what the disk has, so that a later "No space left on device"
# is not a riddle.
tmp_dir=${TMPDIR:-/tmp}
here_kib=$(df -Pk . | awk 'NR == 2 { print $4 }')
tmp_kib=$(df -Pk "$tmp_dir" | awk 'NR == 2 { print $4 }')
echo "disk: $((here_kib / 1048576)) GiB free here, $((tmp_kib / 1048576)) GiB under $tmp_dir"
need_kib=$((5 * 1048576)) tmp_need_kib=$((7 * 1048576))
if [[ $(stat -c %d .) == $(stat -c %d "$tmp_dir") ]]; then
  need_kib=$((need_kib + tmp_need_kib)) tmp_need_kib=0
fi
if ((here_kib < need_kib || tmp_kib < tmp_need_kib)); then
  echo "warning: less free disk than a run needs (~5 GiB here, ~7 GiB under $tmp_dir, ~12 GiB on one disk)" >&2
fi

# ---------------------------------------------------------------- packages
need_pkgs=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in libucx-dev ucx-utils etcd-server protobuf-compiler libprotobuf-dev fonts-dejavu-core iproute2; do
  have_pkg "$pkg" || need_pkgs+=("$pkg")
done
if ((${#need_pkgs[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    log "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || true
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
  else
    echo "missing packages (${need_pkgs[*]}) and not root: tests that need them will skip (or fail under CI=true)" >&2
  fi
fi

# ---------------------------------------------------------------- services
scratch=$(mktemp -d -t ferry-test.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$scratch"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

if command -v etcd >/dev/null; then
  client_port=$(free_port); peer_port=$(free_port)
  log "starting etcd on 127.0.0.1:$client_port"
  etcd --name ferry-test --data-dir "$scratch/etcd" \
    --listen-client-urls "http://127.0.0.1:$client_port" \
    --advertise-client-urls "http://127.0.0.1:$client_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "ferry-test=http://127.0.0.1:$peer_port" \
    >"$scratch/etcd.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$client_port") 2>/dev/null; then break; fi
    sleep 0.1
  done
  export FERRY_TEST_ETCD="http://127.0.0.1:$client_port"
  export FERRY_TEST_ETCD_BIN
  FERRY_TEST_ETCD_BIN=$(command -v etcd)
fi

# ---------------------------------------------------------------- python venv, real libcufile
# One venv for the whole run (the Python bindings' step below adds to it). Under CI pip
# keeps no cache: a fresh machine would only store a second copy of torch's wheel.
if [[ "${CI:-}" == "true" ]]; then
  export PIP_NO_CACHE_DIR=1
fi
if ! python3 -m venv "$scratch/pyvenv" 2>/dev/null; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  fi
  rm -rf "$scratch/pyvenv" && python3 -m venv "$scratch/pyvenv"
fi
# PyTorch's CUDA wheel brings the nvidia-cufile wheel's libcufile.so.0 and loads it at
# `import torch`; without a GPU some cuFile builds (1.17) spin forever inside
# cuFileDriverOpen. Tests given FERRY_TEST_CUFILE load these real libraries and check
# that probing never calls the driver open and that creation is bounded. Installed
# apart from the venv, so the venv's torch loads its own.
log "real libcufile: nvidia-cufile (torch's, CUDA 13) and nvidia-cufile-cu12 wheels"
if "$scratch/pyvenv/bin/pip" install -q --target "$scratch/cufile" nvidia-cufile nvidia-cufile-cu12; then
  FERRY_TEST_CUFILE=$(find "$scratch/cufile" -name libcufile.so.0 | sort | paste -sd: -)
  export FERRY_TEST_CUFILE
  echo "FERRY_TEST_CUFILE=$FERRY_TEST_CUFILE"
else
  echo "cannot install the cuFile wheels: tests that need them will skip (or fail under CI=true)" >&2
fi

# ---------------------------------------------------------------- torch
# torch (the CUDA build from PyPI, ~2.8 GB; it runs on CPU) in the venv, before the Rust
# tests: the TCPStore interop tests run Ferry's client against torch's own servers
# (libuv and legacy) and torch's client against Ferry's server through this python.
torch_started=$SECONDS
"$scratch/pyvenv/bin/pip" install -q maturin numpy pytest torch ziglang
echo "pip install maturin numpy pytest torch ziglang: $((SECONDS - torch_started)) s"
export FERRY_TEST_TORCH_PYTHON="$scratch/pyvenv/bin/python"

# ---------------------------------------------------------------- S3 server (moto)
# The OBJ backend's tests start moto's S3 server (moto[server], pip) on 127.0.0.1
# themselves, one per test (some kill it mid-transfer), and stop it after; they fail
# under CI=true when FERRY_TEST_MOTO_SERVER is not set.
log "S3 server for the OBJ tests: moto[server] (pip)"
if "$scratch/pyvenv/bin/pip" install -q 'moto[server]'; then
  export FERRY_TEST_MOTO_SERVER="$scratch/pyvenv/bin/moto_server"
  echo "FERRY_TEST_MOTO_SERVER=$FERRY_TEST_MOTO_SERVER"
else
  echo "cannot install moto[server]: the OBJ tests will skip (or fail under CI=true)" >&2
fi

# ---------------------------------------------------------------- tests
# CI builds once from a fresh clone: incremental caches (2.7 GB of target/debug) would
# never be reused there, and CI machines' disks can be small.
if [[ "${CI:-}" == "true" ]]; then
  export CARGO_INCREMENTAL=0
fi
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
export RUST_BACKTRACE=1
# The etcd backend (with TLS) is always built and tested under CI (its tests fail there when the
# feature or the server is missing); elsewhere only when protoc is present.
# The encrypted metadata plane (ferry-exchange/tls: rustls + ring, no system library) always.
features=(--features ferry-exchange/tls)
# The OBJ backend (object_store; pure Rust): `ferry backends` and `bench xfer --backend obj`.
features+=(--features ferry-tools/obj)
if [[ "${CI:-}" == "true" ]] || command -v protoc >/dev/null; then
  features+=(--features ferry-exchange/etcd-tls)
fi

log "format, rust-version and lints"
cargo fmt --all -- --check
tools/check-msrv.sh
cargo clippy --workspace --all-targets "${features[@]}" -- -D warnings -D clippy::incompatible_msrv
# The fuzz targets live outside the workspace; keep them compiling on stable (running
# them needs nightly: tools/fuzz.sh).
(cd metadata/fuzz && cargo fmt -- --check && cargo clippy -q --all-targets -- -D warnings)

# The crates as crates.io would get them: docs without warnings, and every published
# crate packaged and built from its .crate (siblings resolved from the other .crates,
# so nothing needs to be on crates.io yet; the crates.io index is read for the rest).
log "packaging: cargo doc --no-deps (warnings denied), cargo publish --dry-run --workspace"
RUSTDOCFLAGS="-D warnings" cargo doc -q --no-deps --workspace
# Cargo unpacks the sibling .crates into $CARGO_HOME/registry/src/-<hash>/ and builds
# them as registry crates, which it takes never to change: a second run on one machine
# would reuse the first run's sources and objects (an API grown since is "missing").
# So the dry run builds in a target dir of its own, whose Ferry crates (and unpacked
# sources) are dropped first; the third-party ones stay cached there.
publish_target="$PWD/target/publish-check"
rm -rf "$publish_target"/debug/.fingerprint/ferry-* "$publish_target"/package \
  "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/ferry-*
CARGO_TARGET_DIR="$publish_target" cargo publish -q --dry-run --workspace --allow-dirty
# Under CI (a fresh clone) nothing reuses it: 1.3 GB freed before the test build.
if [[ "${CI:-}" == "true" ]]; then
  rm -rf "$publish_target"
fi

log "cargo test --workspace ${features[*]}"
cargo test --workspace "${features[@]}" --no-fail-fast

# `ferry backends` probes every backend type: with a real libcufile preloaded and no GPU
# it must return at once (it used to spin forever in cuFileDriverOpen).
if [[ -n "${FERRY_TEST_CUFILE:-}" ]]; then
  log "ferry backends with each real libcufile preloaded (timeout 10 s)"
  ferry_bin="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/debug/ferry"
  IFS=: read -r -a cufile_libs <<<"$FERRY_TEST_CUFILE"
  for lib in "${cufile_libs[@]}"; do
    started_ns=$(date +%s%N)
    # In the scratch dir: a cuFile that was called would write cufile.log there.
    (cd "$scratch" && timeout 10 env LD_PRELOAD="$lib" "$ferry_bin" backends >/dev/null)
    echo "LD_PRELOAD=$lib ferry backends: $((($(date +%s%N) - started_ns) / 1000000)) ms"
  done
fi

# ---------------------------------------------------------------- python bindings
# engine/python (the `ferry` Python module) is outside the workspace: fmt and clippy it,
# build it (debug, sharing target/) with maturin into a venv under the scratch dir,
# run its pytest tests (exit 5, "no tests collected", is a failure too).
py_started=$SECONDS
log "python bindings: fmt, clippy, maturin develop, pytest"
(cd engine/python && cargo fmt -- --check &&
  CARGO_TARGET_DIR="$PWD/../../target" cargo clippy -q --all-targets -- -D warnings)
# torch (installed into the venv before the Rust tests, above) is imported before and
# beside ferry by the tests, which also loads its libcufile.
(cd engine/python && VIRTUAL_ENV="$scratch/pyvenv" PATH="$scratch/pyvenv/bin:$PATH" \
  CARGO_TARGET_DIR="$PWD/../../target" maturin develop -q)
py_rc=0
(cd engine/python/tests && "$scratch/pyvenv/bin/python" -m pytest -q -p no:cacheprovider) || py_rc=$?
if ((py_rc == 5)); then echo "pytest collected no tests" >&2; fi
((py_rc == 0)) || exit 1
# The wheel as it ships (release, abi3, manylinux_2_28 through zig), installed into
# fresh venvs of CPython 3.9 and 3.13 (pyenv's; missing ones fail under CI=true).
wheel_started=$SECONDS
(cd engine/python && PATH="$scratch/pyvenv/bin:$PATH" CARGO_TARGET_DIR="$PWD/../../target" \
  FERRY_WHEEL_DIR="$scratch/wheels" tools/wheel_check.sh)
echo "python wheel check: $((SECONDS - wheel_started)) s"
echo "python bindings step: $((SECONDS - py_started)) s"

log "tracy feature builds"
cargo check -q -p ferry --features tracy
# A viewer's handshake with the in-process Tracy client, events flowing while flushing.
cargo test -q -p ferry-tests --features tracy --test tracy

# The examples a user runs first (engine/examples; `cargo run --example NAME`).
log "examples: kv_transfer (UCX, two processes), kv_offload (POSIX), discovery (TCPStore), kv_transfer_tracy"
for example in kv_transfer kv_offload discovery; do
  cargo run -q -p ferry --example "$example"
done
cargo run -q -p ferry --features tracy-ondemand --example kv_transfer_tracy

log "cuda feature of the tools and benches (VRAM refused with the CUDA driver's reason here)"
cargo clippy -q -p ferry-tools -p ferry-benches --all-targets \
  --features ferry-tools/cuda,ferry-benches/cuda -- -D warnings -D clippy::incompatible_msrv
cargo test -q -p ferry-tools --features cuda --bin ferry --test bench_xfer_vram --test cli
cargo test -q -p ferry-benches --features cuda --lib

if [[ -z "${FERRY_TEST_QUICK:-}" ]]; then
  log "main job smoke run: ferry demo --mib 64"
  cargo run -q -p ferry-tools --bin ferry -- demo --mib 64
fi
log "all tests passed"
