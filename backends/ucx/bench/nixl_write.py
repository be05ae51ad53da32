#!/usr/bin/env python3
"""NIXL baseline for Ferry's UCX benchmark: BLOCK bytes x COUNT shuffled descriptors,
WRITE (or READ) between two NIXL agents in two processes, UCX backend, DRAM.

Run through nixl-compare.sh (which installs NIXL from PyPI into a throwaway venv).
Prints one line per run: median time per transfer, descriptors/s and GB/s.

    python3 nixl_write.py [--block 64] [--count 1024] [--op WRITE] [--seconds 2] [--err-mode none]

--hugepage 1 (default) keeps numpy's behaviour: numpy asks for transparent huge pages
(madvise) on large arrays, so NIXL's 256 MiB buffers are THP-backed where THP is in
`madvise` mode; --hugepage 0 turns that off (plain 4 KiB pages, like a Vec).

--err-mode is NIXL's UCX parameter ucx_error_handling_mode ('peer', NIXL's default, or
'none'; Ferry's shm benchmark variant uses error_handling=none).

--max-iters N stops after N timed requests (default 0: runs for --seconds only); the
comparison passes the same cap to Ferry's bench (FERRY_BENCH_UCX_MAX_ITERS).

The buffers are 2 MiB aligned on both sides (numpy's own start at a page + 16 B).

--cpus 0,1 pins the initiator to CPU 0 and the target to CPU 1 (as nixl_compare.py does
for both Ferry and NIXL). --prog-thread 0 (default) turns off NIXL's agent progress thread in both processes (NIXL
starts one per agent by default; Ferry's benchmark has none): the target then progresses
its agent itself in a loop, as Ferry's target does, and the initiator progresses in its
check loop.
"""
import argparse
import multiprocessing as mp
import os
import random
import time

import numpy as np

BUFFER_LEN = 256 << 20
# Alignment of the buffers, as Ferry's benchmark aligns its own: one transparent huge
# page. numpy's own allocation starts at a page + 16 B, which costs NIXL 6-15 % at 4 KiB.
ALIGN = 2 << 20


def make_agent(name, err_mode, prog_thread):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the nixl-cu12 wheel alone, without the "nixl" meta-package
        from nixl_cu12._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(enable_prog_thread=bool(prog_thread), backends=[])
    agent = nixl_agent(name, config)
    agent.create_backend("UCX", {"ucx_error_handling_mode": err_mode})
    return agent


def set_hugepage(on):
    np.core.multiarray._set_madvise_hugepage(bool(on))


def pin(cpu):
    """Pin this process to `cpu` (None: leave it)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def filled_buffer():
    """The 256 MiB buffer, 2 MiB aligned (ALIGN), every page written once (as Ferry's
    benchmark does): an untouched page reads as the kernel's shared zero page, so a
    transfer from np.zeros memory would read one cache-hot page instead of DRAM.

    A view into a larger allocation; the caller keeps the view, which keeps the whole
    allocation alive."""
    raw = np.empty(BUFFER_LEN + ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    buf = raw[offset:offset + BUFFER_LEN]
    assert buf.ctypes.data % ALIGN == 0
    buf.fill(0x5A)
    return buf


def target(conn, err_mode, hugepage, prog_thread, cpu):
    pin(cpu)
    set_hugepage(hugepage)
    agent = make_agent("nixl-target", err_mode, prog_thread)
    buf = filled_buffer()
    agent.register_memory([(buf.ctypes.data, BUFFER_LEN, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    initiator_md = conn.recv()
    agent.add_remote_agent(initiator_md)
    # Progress until told to stop (getting notifications progresses the UCX worker),
    # as Ferry's benchmark target does; with NIXL's progress thread, just wait.
    while not conn.poll(0 if not prog_thread else None):
        for _ in range(256):
            agent.get_new_notifs()
    conn.recv()  # stop
    del agent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--count", type=int, default=1024)
    ap.add_argument("--op", default="WRITE")
    ap.add_argument("--shuffled", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--err-mode", default="peer")
    ap.add_argument("--hugepage", type=int, default=1)
    ap.add_argument("--prog-thread", type=int, default=0)
    ap.add_argument("--cpus", default="", help="initiator,target CPUs to pin to (e.g. 0,1)")
    ap.add_argument("--max-iters", type=int, default=0,
                    help="stop after this many timed requests (0: only --seconds); "
                         "nixl_compare.py gives Ferry's bench the same cap")
    args = ap.parse_args()
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else [None, None]
    pin(cpus[0])
    set_hugepage(args.hugepage)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    # A daemon: if this side fails, exiting does not wait for the target forever.
    proc = ctx.Process(
        target=target,
        args=(child, args.err_mode, args.hugepage, args.prog_thread, cpus[1]),
        daemon=True,
    )
    proc.start()
    remote_md, remote_base = parent.recv()

    agent = make_agent("nixl-initiator", args.err_mode, args.prog_thread)
    buf = filled_buffer()
    agent.register_memory([(buf.ctypes.data, BUFFER_LEN, 0, "")], "DRAM")
    parent.send(agent.get_agent_metadata())
    name = agent.add_remote_agent(remote_md)
    if isinstance(name, bytes):
        name = name.decode()

    slots = max(BUFFER_LEN // args.block, 1)
    remote_slots = [i % slots for i in range(args.count)]
    if args.shuffled:
        random.Random(7).shuffle(remote_slots)
    local = np.array(
        [(buf.ctypes.data + (i % slots) * args.block, args.block, 0) for i in range(args.count)],
        dtype=np.uint64,
    )
    remote = np.array(
        [(remote_base + s * args.block, args.block, 0) for s in remote_slots], dtype=np.uint64
    )
    local_prep = agent.prep_xfer_dlist("", agent.get_xfer_descs(local, "DRAM"))
    remote_prep = agent.prep_xfer_dlist(name, agent.get_xfer_descs(remote, "DRAM"))
    indices = np.arange(args.count)
    handle = agent.make_prepped_xfer(args.op, local_prep, indices, remote_prep, indices)

    times = []
    started = time.perf_counter()
    first = True
    while first or time.perf_counter() - started < args.seconds:
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state != "DONE":
            if state == "ERR":
                parent.send("stop")
                raise SystemExit(f"NIXL {args.op} {args.block} B x {args.count}: transfer failed")
            state = agent.check_xfer_state(handle)
        if not first:
            times.append(time.perf_counter() - t0)
        first = False
        if args.max_iters and len(times) >= args.max_iters:
            break
    times.sort()
    median = times[len(times) // 2]
    print(
        f"NIXL {args.op} {args.block} B x {args.count} "
        f"{'shuffled' if args.shuffled else 'contiguous'} err={args.err_mode} thp={args.hugepage} "
        f"prog_thread={args.prog_thread}: median {median * 1e6:.1f} us  "
        f"{args.count / median / 1e6:.2f} M desc/s  {args.block * args.count / median / 1e9:.2f} GB/s "
        f"({len(times)} iters)",
        flush=True,
    )
    agent.release_xfer_handle(handle)
    parent.send("stop")
    proc.join()


if __name__ == "__main__":
    main()
