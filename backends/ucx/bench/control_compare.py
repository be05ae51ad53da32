#!/usr/bin/env python3
"""Ferry's one-shot create against NIXL's initialize_xfer, per descriptor, in one run.

Started by control-compare.sh, which provides the NIXL venv, the wheel's libucp
(exported as FERRY_UCX_LIBRARY, so Ferry's UCX backend loads the same library) and
Ferry's control_path criterion binary. Rounds alternate the order (Ferry then NIXL, then
NIXL then Ferry, ...); each figure is the median of the rounds' medians, with the range.

Both sides: 64 B DRAM descriptors, one registered buffer per agent, the remote list
naming a second agent's buffer (contiguous, or shuffled block order), UCX backend,
UCX_NET_DEVICES=lo and the UCX settings of nixl_compare.py, initiator on CPU 0, no
progress thread, nothing posted. A turn is create + release:

- Ferry: `control_path/ucx/create/{layout}/N` (`CommandBuffer::create` + `release`,
  one `Agent::flush`; two agents in the bench's process), the median turn of each
  criterion sample, criterion's median over samples.
- NIXL: `initialize_xfer` + `release_xfer_handle` from Python (nixl_control.py, target
  agent in a second process), lists built before timing, median turn.

    control_compare.py --ferry-bench PATH --python VENV_PYTHON [--rounds 3]

`--kv-layers` compares instead one KV cache's worth: 64 layers × 1,024 blocks of 256 B
(remote layers shuffled, blocks 512 B apart), Ferry's `create` from plain lists and its
prep of 64 strided runs per side + make (`control_path/ucx/kv_layers/{plain,strided}`)
against NIXL's `initialize_xfer` of the same plain lists (`--layouts layers`).

`--ferry-bench LABEL=PATH` may be given more than once (e.g. a build before and after
a change): every build runs in every round, and the table gets a column pair per build
(the ratio is against NIXL).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from nixl_compare import COMMON_ENV  # noqa: E402  (the same UCX environment)

COUNTS = (1024, 16384)
LAYOUTS = ("contiguous", "shuffled")
NIXL_LINE = re.compile(r"^NIXL create (\d+) (\w+): median ([\d.]+) ns/desc")
NIXL_OVERHEAD = re.compile(r"^NIXL overhead: trivial call (\d+) ns, create\+release of 1 descriptor (\d+) ns")


def env():
    e = dict(os.environ)
    e.update(COMMON_ENV)
    e.pop("UCX_TLS", None)
    return e


def criterion(bench, seconds, home, pattern):
    """One run of Ferry's control_path bench on CPU 0, its estimates under `home`."""
    e = env()
    e["CRITERION_HOME"] = home
    cmd = [
        "taskset", "-c", "0", bench, "--bench", "--noplot",
        "--warm-up-time", "1", "--measurement-time", str(seconds), pattern,
    ]
    run = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        print(run.stdout[-2000:], run.stderr[-2000:], file=sys.stderr)
        raise SystemExit("Ferry's control_path bench failed")
    return run


def run_ferry(bench, seconds):
    """{(backend, count, layout): ns/desc} from one criterion run of the create cases."""
    with tempfile.TemporaryDirectory(prefix="ferry-control-") as home:
        run = criterion(bench, seconds, home,
                        r"^control_path(/ucx)?/create/(contiguous|shuffled)/(1024|16384)$")
        found = {}
        for group, backend in (("control_path", "loopback"), ("control_path_ucx", "UCX")):
            for count in COUNTS:
                for layout in LAYOUTS:
                    path = os.path.join(home, group, f"create_{layout}", str(count), "new",
                                        "estimates.json")
                    if os.path.exists(path):
                        with open(path) as f:
                            ns = json.load(f)["median"]["point_estimate"]
                        found[(backend, count, layout)] = ns / count
        if not any(k[0] == "UCX" for k in found):
            print(run.stderr[-2000:], file=sys.stderr)
        return found


KV_COUNT = 64 * 1024
KV_CASES = ("plain", "strided")


def run_ferry_kv(bench, seconds):
    """{case: µs per transfer} from one criterion run of the kv_layers cases."""
    with tempfile.TemporaryDirectory(prefix="ferry-control-") as home:
        run = criterion(bench, seconds, home,
                        rf"^control_path/ucx/kv_layers/(plain|strided)/{KV_COUNT}$")
        found = {}
        for case in KV_CASES:
            path = os.path.join(home, "control_path_ucx", f"kv_layers_{case}", str(KV_COUNT),
                                "new", "estimates.json")
            if os.path.exists(path):
                with open(path) as f:
                    found[case] = json.load(f)["median"]["point_estimate"] / 1e3
        if not found:
            print(run.stderr[-2000:], file=sys.stderr)
        return found


def kv_main(args, builds):
    ferry = {label: {} for label, _ in builds}
    nixl = []
    for r in range(args.rounds):
        sides = [("ferry", label, path) for label, path in builds] + [("nixl", None, None)]
        for side, label, path in sides if r % 2 == 0 else reversed(sides):
            if side == "ferry":
                for case, us in run_ferry_kv(path, args.seconds).items():
                    ferry[label].setdefault(case, []).append(us)
            else:
                found, _ = run_nixl(args.python, args.seconds, counts=[KV_COUNT], block=256,
                                    layouts="layers")
                if (KV_COUNT, "layers") in found:
                    nixl.append(found[(KV_COUNT, "layers")] * KV_COUNT / 1e3)
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    n_cell, n = cell(nixl)
    print("| 64 layers × 1,024 blocks of 256 B, UCX | µs per transfer | NIXL ÷ this |")
    print("|---|---|---|")
    print(f"| NIXL initialize_xfer + release_xfer_handle, plain lists | {n_cell} | 1.00× |")
    for label, _ in builds:
        for case, what in (("plain", "create + release, plain lists"),
                           ("strided", "prep_strided ×2 + make + release")):
            f_cell, f = cell(ferry[label].get(case, []))
            ratio = f"{n / f:.2f}×" if f and n else "—"
            print(f"| {label} {what} | {f_cell} | {ratio} |")
    print(f"{args.rounds} rounds, alternating order; median of rounds (range).")


def run_nixl(python, seconds, counts=COUNTS, block=64, layouts="contiguous,shuffled"):
    cmd = [
        python, os.path.join(HERE, "nixl_control.py"),
        "--counts", ",".join(map(str, counts)), "--seconds", str(seconds), "--cpus", "0,1",
        "--block", str(block), "--layouts", layouts,
    ]
    run = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    found, overhead = {}, None
    for line in run.stdout.splitlines():
        m = NIXL_LINE.match(line.strip())
        if m:
            found[(int(m.group(1)), m.group(2))] = float(m.group(3))
        m = NIXL_OVERHEAD.match(line.strip())
        if m:
            overhead = (int(m.group(1)), int(m.group(2)))
    if not found:
        print(run.stdout[-2000:], run.stderr[-2000:], file=sys.stderr)
    return found, overhead


def cell(values):
    if not values:
        return "—", None
    med = statistics.median(values)
    return f"{med:.1f} ({min(values):.1f}–{max(values):.1f})", med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry-bench", required=True, action="append")
    ap.add_argument("--python", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--kv-layers", action="store_true")
    args = ap.parse_args()
    builds = []
    for spec in args.ferry_bench:
        label, _, path = spec.rpartition("=")
        builds.append((label or "Ferry", path))
    if args.kv_layers:
        kv_main(args, builds)
        return

    ferry = {label: {} for label, _ in builds}
    nixl, overheads = {}, []
    for r in range(args.rounds):
        def ferry_side(label, path):
            def run():
                for key, ns in run_ferry(path, args.seconds).items():
                    ferry[label].setdefault(key, []).append(ns)
            return run

        def nixl_side():
            found, overhead = run_nixl(args.python, args.seconds)
            for key, ns in found.items():
                nixl.setdefault(key, []).append(ns)
            if overhead:
                overheads.append(overhead)

        sides = [ferry_side(label, path) for label, path in builds] + [nixl_side]
        for side in sides if r % 2 == 0 else reversed(sides):
            side()
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)

    head = "| 64 B descriptors |"
    rule = "|---|"
    for label, _ in builds:
        head += f" {label}: create + release, UCX | NIXL ÷ {label} |"
        rule += "---|---|"
    head += " NIXL initialize_xfer + release_xfer_handle, UCX |"
    rule += "---|"
    for label, _ in builds:
        head += f" {label}, loopback |"
        rule += "---|"
    print(head + " (ns/desc)")
    print(rule)
    for count in COUNTS:
        for layout in LAYOUTS:
            n_cell, n = cell(nixl.get((count, layout), []))
            row = f"| {count:,} {layout} |"
            for label, _ in builds:
                f_cell, f = cell(ferry[label].get(("UCX", count, layout), []))
                ratio = f"{n / f:.2f}×" if f and n else "—"
                row += f" {f_cell} | {ratio} |"
            row += f" {n_cell} |"
            for label, _ in builds:
                row += f" {cell(ferry[label].get(('loopback', count, layout), []))[0]} |"
            print(row)
    if overheads:
        trivial = statistics.median(o[0] for o in overheads)
        one = statistics.median(o[1] for o in overheads)
        print(f"\nNIXL's Python overhead per turn: a trivial NIXL call (check_remote_metadata) "
              f"{trivial:.0f} ns; initialize_xfer + release of 1 descriptor {one:.0f} ns "
              f"(= {one / 1024:.2f} ns/desc at 1,024, {one / 16384:.2f} at 16,384).")
    print(f"{args.rounds} rounds, alternating order; median of rounds (range), ns per descriptor.")


if __name__ == "__main__":
    main()
