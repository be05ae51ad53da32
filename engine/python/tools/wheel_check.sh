#!/usr/bin/env bash
# Build Ferry's Python wheel the way it ships (release, stripped, abi3 for CPython >= 3.9,
# manylinux_2_28 through zig) and prove that one wheel installs and works on several
# CPython versions: for each interpreter, a fresh venv, `pip install` of the wheel, then
# an import, a registration of a bytearray, a loopback transfer through ferry.Agent and
# a ferry.nixl agent.
#
#   engine/python/tools/wheel_check.sh [--wheel FILE] [PYTHON ...]
#
# PYTHON defaults to pyenv's 3.9 and 3.13 (/root/.pyenv/versions/3.9*/bin/python3 …).
# Without --wheel it builds one (needs `maturin` and `ziglang`: pip install maturin
# ziglang) into $FERRY_WHEEL_DIR (default: a temporary directory). Prints the wheel's
# name, tags and size. Exit status non-zero on any failure. Under CI=true a missing
# interpreter is a failure; elsewhere it is skipped with the reason.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
wheel=""
pythons=()
while (($#)); do
  case $1 in
    --wheel) wheel=$2; shift 2 ;;
    *) pythons+=("$1"); shift ;;
  esac
done
if ((${#pythons[@]} == 0)); then
  for v in 3.9 3.13; do
    found=$(ls -d /root/.pyenv/versions/"$v".*/bin/python3 2>/dev/null | sort -V | tail -1 || true)
    if [[ -n $found ]]; then
      pythons+=("$found")
    elif [[ ${CI:-} == true ]]; then
      echo "CPython $v not found under /root/.pyenv/versions, and CI=true" >&2
      exit 1
    else
      echo "skipping CPython $v: not found under /root/.pyenv/versions"
    fi
  done
fi
((${#pythons[@]} >= 1)) || { echo "no interpreter to check" >&2; exit 1; }

scratch=$(mktemp -d /tmp/ferry-wheel-check.XXXXXX)
trap 'rm -rf "$scratch"' EXIT

if [[ -z $wheel ]]; then
  out=${FERRY_WHEEL_DIR:-$scratch/wheels}
  started=$SECONDS
  (cd "$here" && maturin build --release --zig --compatibility manylinux_2_28 -q -o "$out")
  echo "wheel build: $((SECONDS - started)) s"
  wheel=$(ls -t "$out"/ferry-*.whl | head -1)
fi
name=$(basename "$wheel")
size=$(stat -c %s "$wheel")
echo "wheel: $name ($((size / 1024)) KiB)"
# Tags: one wheel for every CPython >= 3.9 (abi3), glibc 2.28 or older.
[[ $name == *-cp39-abi3-* ]] || { echo "not an abi3 (cp39) wheel: $name" >&2; exit 1; }
tag=$(sed -E 's/.*-(manylinux_([0-9]+)_([0-9]+)_x86_64)\.whl$/\1 \2 \3/' <<<"$name")
read -r plat major minor <<<"$tag"
if [[ $plat != manylinux_* ]] || ((major > 2 || (major == 2 && minor > 28))); then
  echo "platform tag is not manylinux_2_28 or lower: $name" >&2
  exit 1
fi
echo "tags: cp39-abi3, $plat"

for py in "${pythons[@]}"; do
  ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  venv="$scratch/venv-$ver"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q "$wheel"
  (cd "$scratch" && "$venv/bin/python" - <<'EOF'
import sys
import ferry
import ferry.nixl._api as api

assert ferry.__file__.startswith(sys.prefix), ferry.__file__
buf, out = bytearray(range(256)) * 16, bytearray(4096)
a = ferry.Agent("wheel-a", ferry.AgentConfig(backends=["LOOPBACK"]))
b = ferry.Agent("wheel-b", ferry.AgentConfig(backends=["LOOPBACK"]))
a.register_memory(buf)
b.register_memory(out)
a.add_remote_agent(b.get_agent_metadata())
x = a.initialize_xfer("WRITE", a.get_xfer_descs(buf), a.get_xfer_descs(out), b.name, b"hi")
a.transfer(x)
while a.check_xfer_state(x) != "DONE":
    pass
assert out == buf
n = api.nixl_agent("wheel-nixl", api.nixl_agent_config(backends=["LOOPBACK"]))
assert "LOOPBACK" in n.backends
assert ferry.CUDA, "the wheel is built with VRAM support (feature cuda)"
print(f"CPython {sys.version.split()[0]}: ferry {ferry.__version__} ok "
      f"(prometheus={ferry.PROMETHEUS}, cuda={ferry.CUDA}, plugins={n.get_plugin_list()})")
EOF
  )
done
