#!/usr/bin/env python3
"""Ferry against NIXL on the same libucp and the same UCX environment, in one run.

Started by nixl-compare.sh, which provides the NIXL venv, the wheel's libucp (exported
as FERRY_UCX_LIBRARY, so Ferry's benchmark loads it and nothing else) and Ferry's UCX
benchmark binary. Rounds are interleaved (Ferry, NIXL, limit, then limit, NIXL, Ferry, ...);
both sides run each case for the same time (--seconds) with the same request cap
(--max-iters, default none) from 2 MiB-aligned buffers;
each figure is the median of the rounds, with the range. On both sides the initiator
runs on CPU 0 and the target on CPU 1 (two busy-polling processes on a shared machine
otherwise fall into a slow mode whenever they share a core).

Beside the two, each 1 MiB row gets the limit of its link, measured in the same rounds:
on tcp what one plain TCP stream carries on the same loopback (iperf3, client on CPU 0,
server on CPU 1, 1 MiB writes; READ rows with -R, the server sending), on shared memory
the single-copy limit (memcpy of the same ranges in one process, Ferry's benchmark with
FERRY_BENCH_UCX_MEMCPY=1). "Ferry ÷ limit" is the share of it Ferry reaches.

    nixl_compare.py --ferry-bench PATH --python VENV_PYTHON [--rounds 3]
"""
import argparse
import os
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# The UCX environment both sides run with. Ferry applies these values itself when the
# variables are unset (shared-memory FIFO and segment, ZCOPY_THRESH on UCX >= 1.14,
# RNDV_THRESH); NIXL sets RNDV_THRESH=inf itself. Setting them here makes both equal.
COMMON_ENV = {
    "UCX_NET_DEVICES": "lo",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_ZCOPY_THRESH": "16k",
    "UCX_MM_FIFO_SIZE": "256",
    "UCX_MM_SEG_SIZE": "32768",
    "UCX_RNDV_THRESH": "inf",
}

# (variant, block bytes, count, ops): every workload of the table, the same on both
# transports, both operations each.
SHAPES = [(64, 1024), (4096, 1024), (1 << 20, 1), (1 << 20, 32)]
CASES = [
    (variant, block, count, ("WRITE", "READ"))
    for variant in ("shm", "tcp")
    for block, count in SHAPES
]

# Ferry: error_handling=none on shared memory (its shm variant), peer on tcp;
# NIXL: the same through ucx_error_handling_mode.
ERR_MODE = {"shm": "none", "tcp": "peer"}

FERRY_LINE = re.compile(
    r"^(WRITE|READ)\s+block\s+(\d+)\s+(B|KiB|MiB)\s+×\s+(\d+)\s+(shuffled|contiguous)\s+"
    r"merged\s+\d+\s+median\s+([\d.]+)\s+µs"
)
MEMCPY_LINE = re.compile(r"^MEMCPY block (\d+) B × (\d+) \w+ median ([\d.]+) µs")
NIXL_LINE = re.compile(r"^NIXL (WRITE|READ) (\d+) B x (\d+) .*median ([\d.]+) us")
MD_LINE = re.compile(
    r"^(?:NIXL )?METADATA regions (\d+) bytes (\d+) encode median ([\d.]+) (?:µs|us) "
    r"load median ([\d.]+) (?:µs|us)"
)
# Regions of the metadata rows (1 MiB each, 2 MiB apart, registered one by one).
MD_REGIONS = 15000
UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}


def env_for(variant):
    env = dict(os.environ)
    env.update(COMMON_ENV)
    if variant == "tcp":
        env["UCX_TLS"] = "tcp"
    else:
        env.pop("UCX_TLS", None)
    return env


def run_ferry(bench, variant, block, count, ops, seconds, max_iters):
    """Median µs per request of Ferry's benchmark, by (op, block, count), shuffled."""
    env = env_for(variant)
    env.update(
        {
            "FERRY_BENCH_UCX_VARIANT": variant,
            "FERRY_BENCH_UCX_BLOCKS": str(block),
            "FERRY_BENCH_UCX_BATCHES": str(count),
            "FERRY_BENCH_UCX_IDLE": "0",
            "FERRY_BENCH_UCX_TARGET_CPU": "1",
            # Only what the table reads: the shuffled layout, the row's operations.
            "FERRY_BENCH_UCX_ORDER": "shuffled",
            "FERRY_BENCH_UCX_OPS": ",".join(op.lower() for op in ops),
            "FERRY_BENCH_UCX_CONTROL": "0",
            # As long per case as NIXL's side, and the same request cap (0: none).
            "FERRY_BENCH_UCX_CASE_MS": str(int(seconds * 1000)),
            "FERRY_BENCH_UCX_MAX_ITERS": str(max_iters),
        }
    )
    out = subprocess.run(
        ["taskset", "-c", "0", bench], env=env, capture_output=True, text=True, timeout=600
    ).stdout
    found = {}
    for line in out.splitlines():
        m = FERRY_LINE.match(line.strip())
        if m and m.group(5) == "shuffled":
            size = int(m.group(2)) * UNIT[m.group(3)]
            found[(m.group(1), size, int(m.group(4)))] = float(m.group(6))
    return found


def run_nixl(python, variant, block, count, op, seconds, max_iters):
    env = env_for(variant)
    cmd = [
        python,
        os.path.join(HERE, "nixl_write.py"),
        "--block", str(block), "--count", str(count), "--op", op,
        "--shuffled", "1", "--err-mode", ERR_MODE[variant],
        "--seconds", str(seconds), "--max-iters", str(max_iters),
        "--prog-thread", "0", "--cpus", "0,1",
    ]
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        print(f"NIXL {variant} {op} {block} B x {count}: timed out", file=sys.stderr)
        return None
    if "transfer failed" in run.stderr:
        print(f"NIXL {variant} {op} {block} B x {count}: transfer failed", file=sys.stderr)
    out = run.stdout
    for line in out.splitlines():
        m = NIXL_LINE.match(line.strip())
        if m:
            return float(m.group(4))
    return None


def run_memcpy(bench, block, count, seconds):
    """Median µs per request of memcpy of the same ranges (the single-copy limit)."""
    env = dict(os.environ)
    env.update({
        "FERRY_BENCH_UCX_MEMCPY": "1",
        "FERRY_BENCH_UCX_BLOCKS": str(block),
        "FERRY_BENCH_UCX_BATCHES": str(count),
        "FERRY_BENCH_UCX_ORDER": "shuffled",
        "FERRY_BENCH_UCX_CASE_MS": str(int(seconds * 1000)),
    })
    out = subprocess.run(
        ["taskset", "-c", "0", bench], env=env, capture_output=True, text=True, timeout=600
    ).stdout
    for line in out.splitlines():
        m = MEMCPY_LINE.match(line.strip())
        if m:
            return float(m.group(3))
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_iperf3(block, count, op, seconds):
    """µs per request of block × count bytes at the rate one iperf3 stream carries on
    loopback (1 MiB writes; READ = the server sends, -R). None after 5 failed tries."""
    for _ in range(5):
        port = free_port()
        server = subprocess.Popen(
            ["taskset", "-c", "1", "iperf3", "-s", "-1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)  # until it listens
            cmd = ["taskset", "-c", "0", "iperf3", "-c", "127.0.0.1", "-p", str(port),
                   "-t", str(max(1, round(seconds))), "-l", str(min(block, 1 << 20)), "-J"]
            if op == "READ":
                cmd.append("-R")
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            try:
                # A failed client answers {"error": ...} instead.
                bps = json.loads(run.stdout)["end"]["sum_received"]["bits_per_second"]
                return block * count / (bps / 8) * 1e6
            except (ValueError, KeyError, TypeError):
                print(f"iperf3 {op}: {run.stdout[-200:]}{run.stderr[-200:]}", file=sys.stderr)
        finally:
            server.kill()
            server.wait()
    return None


def run_limit(bench, variant, block, count, op, seconds):
    if block < 1 << 20:
        return None
    if variant == "tcp":
        return run_iperf3(block, count, op, seconds)
    return run_memcpy(bench, block, count, seconds)


def run_ferry_md(bench):
    """(bytes, encode µs, load µs) of Ferry's metadata for MD_REGIONS UCX regions."""
    env = env_for("shm")
    env["FERRY_BENCH_UCX_METADATA"] = str(MD_REGIONS)
    out = subprocess.run(
        ["taskset", "-c", "0", bench], env=env, capture_output=True, text=True, timeout=600
    ).stdout
    return parse_md(out)


def run_nixl_md(python):
    env = env_for("shm")
    cmd = [python, os.path.join(HERE, "nixl_md.py"), "--regions", str(MD_REGIONS),
           "--err-mode", "none"]
    try:
        out = subprocess.run(
            ["taskset", "-c", "0"] + cmd, env=env, capture_output=True, text=True, timeout=600
        ).stdout
    except subprocess.TimeoutExpired:
        print("NIXL metadata: timed out", file=sys.stderr)
        return None
    return parse_md(out)


def parse_md(out):
    for line in out.splitlines():
        m = MD_LINE.match(line.strip())
        if m:
            return int(m.group(2)), float(m.group(3)), float(m.group(4))
    return None


def figure(block, count, us):
    """(value, unit): M desc/s below 4 KiB, else GB/s."""
    if block < 4096:
        return count / us, "M desc/s"
    return block * count / us / 1e3, "GB/s"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry-bench", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", "--nixl-seconds", dest="seconds", type=float, default=1.5,
                    help="timed seconds per case, both sides")
    ap.add_argument("--max-iters", type=int, default=0,
                    help="timed requests after which a case stops, both sides (0: none)")
    ap.add_argument(
        "--only", default="",
        help="comma list of VARIANT:BLOCK:COUNT rows to run (e.g. tcp:1048576:32); "
             "leaves out the other rows and the metadata rows")
    args = ap.parse_args()
    cases = CASES
    if args.only:
        wanted = {tuple(w.split(":")) for w in args.only.split(",") if w}
        cases = [c for c in CASES if (c[0], str(c[1]), str(c[2])) in wanted]
        if not cases:
            ap.error(f"--only {args.only!r} names none of the rows "
                     f"({', '.join(f'{v}:{b}:{n}' for v, b, n, _ in CASES)})")

    if shutil.which("iperf3") is None:
        ap.error("iperf3 not found (Debian package iperf3): the tcp rows' limit needs it")
    ferry = {}  # (variant, op, block, count) -> [µs]
    nixl = {}
    limit = {}
    md = {"Ferry": [], "NIXL": []}  # [(bytes, encode µs, load µs)]
    for r in range(args.rounds):
        md_sides = [("Ferry", lambda: run_ferry_md(args.ferry_bench)),
                    ("NIXL", lambda: run_nixl_md(args.python))]
        for name, side in ([] if args.only else md_sides if r % 2 == 0 else md_sides[::-1]):
            got = side()
            if got is not None:
                md[name].append(got)
        if not args.only:
            print(f"round {r + 1}: metadata done", file=sys.stderr, flush=True)
        for variant, block, count, ops in cases:
            def ferry_side():
                got = run_ferry(args.ferry_bench, variant, block, count, ops, args.seconds,
                                args.max_iters)
                for op in ops:
                    if (op, block, count) in got:
                        ferry.setdefault((variant, op, block, count), []).append(
                            got[(op, block, count)]
                        )

            def nixl_side():
                for op in ops:
                    us = run_nixl(args.python, variant, block, count, op, args.seconds,
                                  args.max_iters)
                    if us is not None:
                        nixl.setdefault((variant, op, block, count), []).append(us)

            def limit_side():
                for op in ops:
                    us = run_limit(args.ferry_bench, variant, block, count, op, args.seconds)
                    if us is not None:
                        limit.setdefault((variant, op, block, count), []).append(us)

            sides = [ferry_side, nixl_side, limit_side]
            if r % 2:
                sides.reverse()
            for side in sides:
                side()
            print(f"round {r + 1}: {variant} {block} B x {count} done", file=sys.stderr, flush=True)

    print("| workload | Ferry | NIXL | Ferry ÷ NIXL | limit (tcp: iperf3, shm: memcpy) "
          "| Ferry ÷ limit |")
    print("|---|---|---|---|---|---|")
    for variant, block, count, ops in cases:
        for op in ops:
            key = (variant, op, block, count)
            cells = []
            values = []
            for table in (ferry, nixl, limit):
                times = table.get(key, [])
                if not times:
                    cells.append("—")
                    values.append(None)
                    continue
                figs = sorted(figure(block, count, t)[0] for t in times)
                unit = figure(block, count, times[0])[1]
                med = statistics.median(figs)
                values.append(med)
                cells.append(f"{med:.2f} ({figs[0]:.2f}–{figs[-1]:.2f}) {unit}")
            ratio = (
                f"{values[0] / values[1]:.2f}×"
                if None not in values[:2] and values[1] else "—"
            )
            share = (
                f"{values[0] / values[2] * 100:.0f} %"
                if None not in (values[0], values[2]) and values[2] else "—"
            )
            size = f"{block >> 20} MiB" if block >= 1 << 20 else (
                f"{block >> 10} KiB" if block >= 1024 else f"{block} B")
            name = f"{variant}, {size} × {count} shuffled {op}"
            print(f"| {name} | {cells[0]} | {cells[1]} | {ratio} | {cells[2]} | {share} |")
    if args.only:
        # A focused run: the rounds paired (each round ran both sides back to back).
        for variant, block, count, ops in cases:
            for op in ops:
                key = (variant, op, block, count)
                pairs = list(zip(ferry.get(key, []), nixl.get(key, [])))
                if pairs:
                    # Times, so NIXL's ÷ Ferry's is Ferry's rate ÷ NIXL's.
                    ratios = [n / f for f, n in pairs]
                    print(f"{variant} {block} B x {count} {op}: per-round Ferry ÷ NIXL "
                          + " ".join(f"{x:.2f}" for x in ratios)
                          + f"; median {statistics.median(ratios):.2f}×")
                # Against the limit measured in the same round: a slow phase of the VM
                # that spans a round weighs on both figures of its ratio.
                pairs = list(zip(ferry.get(key, []), limit.get(key, [])))
                if pairs:
                    shares = [lim / f * 100 for f, lim in pairs]
                    print(f"{variant} {block} B x {count} {op}: per-round Ferry ÷ limit "
                          + " ".join(f"{x:.0f} %" for x in shares)
                          + f"; median {statistics.median(shares):.0f} %")
        return
    print_md_rows(md)


def print_md_rows(md):
    """Metadata rows: smaller is better, so the ratio is NIXL ÷ Ferry."""
    rows = [
        ("bytes", lambda t: t[0], "{:,.0f} B"),
        ("encode (local metadata)", lambda t: t[1], "{:.0f} µs"),
        ("load (a fresh agent)", lambda t: t[2], "{:.0f} µs"),
        ("encode + load", lambda t: t[1] + t[2], "{:.0f} µs"),
    ]
    for label, pick, fmt in rows:
        cells, values = [], []
        for side in ("Ferry", "NIXL"):
            got = sorted(pick(t) for t in md[side])
            if not got:
                cells.append("—")
                values.append(None)
                continue
            med = statistics.median(got)
            values.append(med)
            rng = f" ({fmt.format(got[0])}–{fmt.format(got[-1])})" if len(got) > 1 else ""
            cells.append(fmt.format(med) + rng)
        ratio = (f"{values[1] / values[0]:.2f}× (NIXL ÷ Ferry)"
                 if None not in values and values[0] else "—")
        print(f"| metadata of {MD_REGIONS:,} UCX regions: {label} | {cells[0]} | {cells[1]} "
              f"| {ratio} | | |")


if __name__ == "__main__":
    main()
