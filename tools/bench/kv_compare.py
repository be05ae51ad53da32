#!/usr/bin/env python3
"""Driver of kv-compare.sh: `ferry bench kv` and kv_nixl.py, interleaved rounds.

Configurations (each a separate pair of processes on this host, unpinned):
  - Ferry, UCX: `ferry bench kv --backend ucx --ucx-library LIBUCP` (Ferry's UCX
    defaults: error_handling=peer, am_tcp=auto, initiator polls in its loop, the
    spawned target progressed by UCX's progress thread);
  - Ferry, default: `ferry bench kv` (the default set; the same-host target is reached
    through SHM; the set's UCX loads LIBUCP too);
  - NIXL, default: kv_nixl.py (nixl_agent_config(enable_prog_thread=True), UCX backend
    with NIXL's default parameters, error mode peer);
  - NIXL, no progress thread: the same with enable_prog_thread=False (the initiator's
    UCX work then happens in its own calls, as Ferry's initiator polls; the target
    progresses in a get_new_notifs loop).
Round r runs the configurations in order, reversed in odd rounds. Every figure is the
median over rounds, with the range. The environment is the same for all: the UCX
variables below (as backends/ucx/bench/nixl_compare.py sets them).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {
    "UCX_NET_DEVICES": "lo",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_ZCOPY_THRESH": "16k",
    "UCX_MM_FIFO_SIZE": "256",
    "UCX_MM_SEG_SIZE": "32768",
    "UCX_RNDV_THRESH": "inf",
}
# (label, op, layout): the table's workloads; the shape is both tools' defaults
# (32 layers, 16 KiB blocks, 16 blocks per request = 512 descriptors, 8 in flight,
# 2 new per tick, a 256-block pool per layer = 128 MiB per side).
WORKLOADS = [
    ("READ, paged", "READ", "paged"),
    ("WRITE, paged", "WRITE", "paged"),
]
LINE = re.compile(r"^KV (?:NIXL )?ticks (\d+) (.*)$")
FIELDS = ["tick_p50_us", "tick_p99_us", "request_p50_us", "request_p99_us", "gbps", "descs_per_s"]


def parse(out):
    for line in out.splitlines():
        m = LINE.match(line.strip())
        if m:
            words = m.group(2).split()
            kv = dict(zip(words[::2], words[1::2]))
            got = {k: float(kv[k]) for k in FIELDS}
            got["via"] = kv.get("via", "UCX")
            return got
    return None


def run(cmd):
    env = dict(os.environ)
    env.update(ENV)
    env.pop("UCX_TLS", None)
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        print(f"timed out: {' '.join(cmd)}", file=sys.stderr)
        return None
    got = parse(p.stdout)
    if got is None:
        print(f"no KV line from {' '.join(cmd)}:\n{p.stdout}\n{p.stderr}", file=sys.stderr)
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--ucx-library", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=500)
    a = ap.parse_args()
    common = ["--requests", str(a.requests), "--warmup", str(max(a.requests // 10, 20))]
    configs = [
        ("Ferry, UCX", lambda op, layout: [a.ferry, "bench", "kv", "--backend", "ucx",
                                           "--ucx-library", a.ucx_library, "--op", op.lower(),
                                           "--layout", layout] + common),
        ("Ferry, default", lambda op, layout: [a.ferry, "bench", "kv", "--ucx-library",
                                               a.ucx_library, "--op", op.lower(),
                                               "--layout", layout] + common),
        ("NIXL, default", lambda op, layout: [a.python, os.path.join(HERE, "kv_nixl.py"),
                                              "--op", op, "--layout", layout] + common),
        ("NIXL, no progress thread", lambda op, layout: [
            a.python, os.path.join(HERE, "kv_nixl.py"), "--op", op, "--layout", layout,
            "--prog-thread", "0"] + common),
    ]
    results = {}  # (workload, config) -> [dict]
    for r in range(a.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for label, op, layout in WORKLOADS:
            for name, cmd in order:
                got = run(cmd(op, layout))
                if got is not None:
                    results.setdefault((label, name), []).append(got)
            print(f"round {r + 1}: {label} done", file=sys.stderr, flush=True)
    print("| workload | configuration | via | GB/s | descriptors/s | tick p50 µs | tick p99 µs "
          "| request p50 µs | request p99 µs |")
    print("|---|---|---|---|---|---|---|---|---|")

    def cell(runs, key, fmt):
        v = sorted(x[key] for x in runs)
        return f"{fmt.format(statistics.median(v))} ({fmt.format(v[0])}–{fmt.format(v[-1])})"

    for label, _, _ in WORKLOADS:
        for name, _ in configs:
            runs = results.get((label, name), [])
            if not runs:
                print(f"| {label} | {name} | — | — | — | — | — | — | — |")
                continue
            print(f"| {label} | {name} | {runs[0]['via']} | {cell(runs, 'gbps', '{:.2f}')} "
                  f"| {cell(runs, 'descs_per_s', '{:,.0f}')} | {cell(runs, 'tick_p50_us', '{:.1f}')} "
                  f"| {cell(runs, 'tick_p99_us', '{:.0f}')} | {cell(runs, 'request_p50_us', '{:.0f}')} "
                  f"| {cell(runs, 'request_p99_us', '{:.0f}')} |")
        nixl = results.get((label, "NIXL, default"), [])
        for name in ("Ferry, UCX", "Ferry, default"):
            mine = results.get((label, name), [])
            if mine and nixl:
                ratio = statistics.median(x["gbps"] for x in mine) / statistics.median(
                    x["gbps"] for x in nixl)
                print(f"{label}: {name} ÷ NIXL GB/s (medians) {ratio:.2f}×", file=sys.stderr)
    print(f"n = {a.rounds} rounds, {a.requests} timed requests per run", file=sys.stderr)


if __name__ == "__main__":
    main()
