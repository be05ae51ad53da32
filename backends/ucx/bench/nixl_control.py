#!/usr/bin/env python3
"""NIXL's control path, per descriptor: `initialize_xfer` (the one-shot create that preps
both lists) + `release_xfer_handle`, for COUNT descriptors of BLOCK bytes, contiguous or
shuffled on the remote side, UCX backend, DRAM, a remote agent in a second process whose
metadata the initiator loaded.

Run through control-compare.sh (which provides the NIXL venv). The descriptor lists are
built once, before timing (`get_xfer_descs` of an (N, 3) array), so a timed turn is one
Python call into NIXL's C++ `createXferReq` and one into its release. Nothing is posted
(no byte moves); the target process only waits.

Prints one line per case:

    NIXL create COUNT shuffled: median X ns/desc (init Y, release Z ns/desc) ITERS iters

and one line with the Python call overhead: a trivial NIXL call (`check_remote_metadata`
with a prepared empty list: the Python wrapper, one pybind11 call, one C++ map lookup),
and `initialize_xfer` + release of a single descriptor (all fixed cost per call).

    python3 nixl_control.py [--counts 1024,16384] [--block 64] [--seconds 1.5] [--cpus 0,1]

Layout `layers` is a KV cache's shape: COUNT / 1,024 layers of 1,024 blocks, the local
layers side by side, the remote layers in shuffled order with their blocks 2 × BLOCK
apart (Ferry's `control_path/ucx/kv_layers` case, 64 layers x 1,024 blocks of 256 B).
"""
import argparse
import multiprocessing as mp
import os
import random
import statistics
import time

import numpy as np


def nixl_api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
        from nixl._bindings import nixlXferDList, DRAM_SEG
    except ImportError:  # the nixl-cu12 wheel alone, without the "nixl" meta-package
        from nixl_cu12._api import nixl_agent, nixl_agent_config
        from nixl_cu12._bindings import nixlXferDList, DRAM_SEG
    return nixl_agent, nixl_agent_config, nixlXferDList, DRAM_SEG


def make_agent(name):
    nixl_agent, nixl_agent_config, _, _ = nixl_api()
    # No progress thread (Ferry has none either); the UCX backend as NIXL ships it.
    config = nixl_agent_config(enable_prog_thread=False, backends=[])
    agent = nixl_agent(name, config)
    agent.create_backend("UCX", {})
    return agent


def pin(cpu):
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def target(conn, length, cpu):
    pin(cpu)
    agent = make_agent("nixl-ctl-target")
    buf = np.zeros(length, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, length, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    agent.add_remote_agent(conn.recv())
    conn.recv()  # stop
    del agent


def timed(fn, seconds, min_iters=50):
    """Per-call times (s) of `fn` for about `seconds`, after one untimed call."""
    fn()
    times = []
    started = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1024,16384")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--layouts", default="contiguous,shuffled")
    ap.add_argument("--cpus", default="", help="initiator,target CPUs (e.g. 0,1)")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    layouts = args.layouts.split(",")
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else [None, None]
    pin(cpus[0])
    _, _, nixlXferDList, DRAM_SEG = nixl_api()

    # `layers` spaces the remote blocks two apart.
    length = max(counts) * args.block * (2 if "layers" in layouts else 1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, length, cpus[1]), daemon=True)
    proc.start()
    remote_md, remote_base = parent.recv()
    agent = make_agent("nixl-ctl-initiator")
    buf = np.zeros(length, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, length, 0, "")], "DRAM")
    parent.send(agent.get_agent_metadata())
    name = agent.add_remote_agent(remote_md)
    if isinstance(name, bytes):
        name = name.decode()

    def lists(count, layout):
        local = np.array(
            [(buf.ctypes.data + i * args.block, args.block, 0) for i in range(count)],
            dtype=np.uint64,
        )
        if layout == "layers":
            blocks = 1024
            order = list(range(count // blocks))
            random.Random(count).shuffle(order)
            at = [
                remote_base + (layer * blocks + b) * 2 * args.block
                for layer in order
                for b in range(blocks)
            ]
        else:
            order = list(range(count))
            if layout == "shuffled":
                random.Random(count).shuffle(order)
            at = [remote_base + j * args.block for j in order]
        remote = np.array([(a, args.block, 0) for a in at], dtype=np.uint64)
        return agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM")

    # Python call overhead: a trivial call, and a one-descriptor create + release.
    empty = nixlXferDList(DRAM_SEG)
    trivial = statistics.median(timed(lambda: agent.check_remote_metadata(name, empty), 0.3))
    one_l, one_r = lists(1, "contiguous")

    def one():
        agent.release_xfer_handle(agent.initialize_xfer("WRITE", one_l, one_r, name))

    one_call = statistics.median(timed(one, 0.3))
    print(
        f"NIXL overhead: trivial call {trivial * 1e9:.0f} ns, "
        f"create+release of 1 descriptor {one_call * 1e9:.0f} ns",
        flush=True,
    )

    for count in counts:
        for layout in layouts:
            local, remote = lists(count, layout)
            init_t, release_t, total = [], [], []
            deadline = time.perf_counter() + args.seconds
            first = True
            while first or len(total) < 20 or time.perf_counter() < deadline:
                t0 = time.perf_counter()
                handle = agent.initialize_xfer("WRITE", local, remote, name)
                t1 = time.perf_counter()
                agent.release_xfer_handle(handle)
                t2 = time.perf_counter()
                if not first:
                    init_t.append(t1 - t0)
                    release_t.append(t2 - t1)
                    total.append(t2 - t0)
                first = False
            per = 1e9 / count
            print(
                f"NIXL create {count} {layout}: median {statistics.median(total) * per:.2f} ns/desc "
                f"(init {statistics.median(init_t) * per:.2f}, "
                f"release {statistics.median(release_t) * per:.2f} ns/desc) "
                f"{len(total)} iters",
                flush=True,
            )
    parent.send("stop")
    proc.join()


if __name__ == "__main__":
    main()
