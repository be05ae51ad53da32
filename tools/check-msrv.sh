#!/usr/bin/env bash
# Check that the workspace's `rust-version` is honest, with what a machine that has only
# a recent toolchain can show:
#   1. every workspace member declares it (`rust-version.workspace = true`), so cargo
#      and clippy's `incompatible_msrv` lint apply it to every crate;
#   2. no dependency the workspace builds (normal, build and dev edges, all features
#      the tests use, this platform) needs a newer Rust than declared;
#   3. it is no higher than needed: above the dependencies' floor it must be justified
#      by our own code, which `cargo clippy` shows — tools/test.sh runs clippy with
#      `-D clippy::incompatible_msrv`, which fails on any std API newer than declared.
# (Language syntax newer than the declared version is not covered by the lint; at the
# time of writing the workspace uses none past 1.82 — see ARCHITECTURE.md.)
set -euo pipefail
cd "$(dirname "$0")/.."

declared=$(sed -n 's/^rust-version *= *"\(.*\)"/\1/p' Cargo.toml | head -n 1)
if [[ -z $declared ]]; then
  echo "check-msrv: no rust-version in the root Cargo.toml [workspace.package]" >&2
  exit 1
fi

features=(--features ferry-exchange/etcd)
used=$(mktemp)
meta=$(mktemp)
trap 'rm -f "$used" "$meta"' EXIT
cargo tree -q --workspace "${features[@]}" -e normal,build,dev --prefix none --format '{p}' |
  awk '{ v = $2; sub(/^v/, "", v); print $1 "@" v }' | sort -u >"$used"

cargo metadata -q --format-version 1 "${features[@]}" >"$meta"
DECLARED=$declared USED=$used META=$meta python3 - <<'PY'
import json, os, sys

def key(v):
    parts = [int(x) for x in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))

declared = os.environ["DECLARED"]
used = set(open(os.environ["USED"]).read().split())
meta = json.load(open(os.environ["META"]))
members = set(meta["workspace_members"])
failed = False
floor, floor_by = "0", []
for p in meta["packages"]:
    name, rv = p["name"], p.get("rust_version")
    if p["id"] in members:
        if rv is None or key(rv) != key(declared):
            print(f"check-msrv: {name} declares rust-version {rv}, the workspace {declared}:"
                  " add `rust-version.workspace = true`", file=sys.stderr)
            failed = True
        continue
    if f"{name}@{p['version']}" not in used or rv is None:
        continue
    if key(rv) > key(declared):
        print(f"check-msrv: dependency {name} {p['version']} needs Rust {rv},"
              f" more than the declared {declared}", file=sys.stderr)
        failed = True
    if key(rv) > key(floor):
        floor, floor_by = rv, []
    if key(rv) == key(floor):
        floor_by.append(name)
print(f"check-msrv: declared rust-version {declared}; dependencies need at least {floor}"
      f" ({', '.join(sorted(floor_by))})")
if key(declared) > key(floor):
    print(f"check-msrv: {declared} is above the dependency floor {floor}; only our own code"
          " can justify that (clippy's incompatible_msrv names what needs it)")
sys.exit(1 if failed else 0)
PY
