#!/usr/bin/env python3
"""NIXL's twin of `ferry bench kv`: the same KV-cache loop through NIXL's Python API.

The loop is the one vLLM's NixlConnector drives (and `ferry bench kv` records into a
command buffer, tools/src/xfer/kv.rs): both processes hold a KV pool of LAYERS x
POOL_BLOCKS blocks of BLOCK bytes, layer-major, prepared once per side with
prep_xfer_dlist. A request moves BLOCKS_PER_REQUEST blocks in every layer: remote
blocks drawn at random from the peer's pool (paged: scattered; contiguous: a run),
local blocks from a free slot of this side's pool. Each tick releases the handles that
finished at the previous tick, admits up to NEW_PER_TICK requests while fewer than
IN_FLIGHT are outstanding (make_prepped_xfer with notif_msg b"req-N", transfer), and
checks every older one (check_xfer_state). Tick latency is the time spent in NIXL's
calls per tick (the index arrays are built with numpy, as vLLM does, inside the tick);
request latency runs from the tick that admitted a request to the one that saw it DONE.

Two processes (multiprocessing, spawn): the target registers its pool and serves
(get_new_notifs in a loop, or NIXL's progress thread), the initiator runs the loop.
NIXL's configuration: nixl_agent(name, nixl_agent_config(enable_prog_thread=...,
backends=[])) + create_backend("UCX", {...}) with NIXL's default UCX parameters unless
--err-mode is given. Prints one line the comparison script parses:

    KV NIXL ticks T tick_p50_us X tick_p99_us Y tick_max_us Z request_p50_us A
       request_p99_us B requests N gbps G descs_per_s D

    python3 kv_nixl.py [--op READ] [--layers 32] [--block 16384] [--blocks-per-request 16]
        [--in-flight 8] [--new-per-tick 2] [--pool-blocks N] [--layout paged]
        [--requests 2000] [--warmup 200] [--prog-thread 1]
"""
import argparse
import multiprocessing as mp
import time

import numpy as np


def make_agent(name, prog_thread, err_mode):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the nixl-cu12 wheel alone, without the "nixl" meta-package
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=bool(prog_thread), backends=[]))
    params = {} if err_mode == "default" else {"ucx_error_handling_mode": err_mode}
    agent.create_backend("UCX", params)
    return agent


def pool(nbytes):
    """The pool, every page written once (an untouched page would read as the zero page)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0x5A)
    return buf


def pool_descs(base, layers, pool_blocks, block):
    index = np.arange(layers * pool_blocks, dtype=np.uint64)
    return np.stack(
        [base + index * np.uint64(block), np.full_like(index, block), np.zeros_like(index)],
        axis=1,
    )


def target(conn, nbytes, prog_thread, err_mode):
    agent = make_agent("nixl-kv-target", prog_thread, err_mode)
    buf = pool(nbytes)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    agent.add_remote_agent(conn.recv())
    notes = 0
    while not conn.poll(0 if not prog_thread else 0.001):
        for msgs in agent.get_new_notifs().values():
            notes += len(msgs)
    conn.recv()
    conn.send(notes)
    del agent


def quantile(v, q):
    if not v:
        return 0.0
    s = sorted(v)
    rank = min(max(int(np.ceil(q * len(s))), 1), len(s))
    return s[rank - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="READ", choices=["READ", "WRITE"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block", type=int, default=16384)
    ap.add_argument("--blocks-per-request", type=int, default=16)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--new-per-tick", type=int, default=2)
    ap.add_argument("--pool-blocks", type=int, default=0)
    ap.add_argument("--layout", default="paged", choices=["paged", "contiguous"])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--prog-thread", type=int, default=1, help="NIXL's default: 1")
    ap.add_argument("--err-mode", default="default", help="default (NIXL's: peer), peer, none")
    a = ap.parse_args()
    n = a.blocks_per_request
    need = a.in_flight * n
    pool_blocks = a.pool_blocks or max(2 * need, 256)
    if pool_blocks < need:
        raise SystemExit(f"--pool-blocks {pool_blocks} cannot hold {need} blocks in flight")
    nbytes = a.layers * pool_blocks * a.block

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, nbytes, a.prog_thread, a.err_mode), daemon=True)
    proc.start()
    remote_md, remote_base = parent.recv()
    agent = make_agent("nixl-kv-initiator", a.prog_thread, a.err_mode)
    buf = pool(nbytes)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    parent.send(agent.get_agent_metadata())
    name = agent.add_remote_agent(remote_md)
    if isinstance(name, bytes):
        name = name.decode()
    local_prep = agent.prep_xfer_dlist(
        "", agent.get_xfer_descs(pool_descs(buf.ctypes.data, a.layers, pool_blocks, a.block), "DRAM"))
    remote_prep = agent.prep_xfer_dlist(
        name, agent.get_xfer_descs(pool_descs(remote_base, a.layers, pool_blocks, a.block), "DRAM"))
    # Handshake: the first transfer connects (as Ferry's first post does).
    rng = np.random.default_rng(0x6B765F62656E6368)
    local_map = np.arange(pool_blocks)
    if a.layout == "paged":
        rng.shuffle(local_map)
    layer_base = (np.arange(a.layers) * pool_blocks)[:, None]
    free_slots = list(range(a.in_flight - 1, -1, -1))
    total = a.warmup + a.requests
    active = []  # [slot, admitted_at, handle, timed]
    to_release = []
    admitted = finished = 0
    ticks, tick_us, request_us = 0, [], []
    nbytes_timed = ndescs = 0
    timed_since = None
    while finished < total:
        t0 = time.perf_counter()
        for h in to_release:
            agent.release_xfer_handle(h)
        to_release.clear()
        new = 0
        fresh = []
        while new < a.new_per_tick and admitted < total and free_slots:
            slot = free_slots.pop()
            if admitted == a.warmup:
                timed_since = t0
            if a.layout == "paged":
                remote_blocks = rng.choice(pool_blocks, size=n, replace=False)
            else:
                start = int(rng.integers(0, pool_blocks - n + 1))
                remote_blocks = np.arange(start, start + n)
            local_blocks = local_map[slot * n:(slot + 1) * n]
            local_idx = (layer_base + local_blocks[None, :]).ravel()
            remote_idx = (layer_base + remote_blocks[None, :]).ravel()
            h = agent.make_prepped_xfer(a.op, local_prep, local_idx, remote_prep, remote_idx,
                                        notif_msg=f"req-{admitted}".encode())
            state = agent.transfer(h)
            if state == "ERR":
                raise SystemExit(f"NIXL: transfer of req-{admitted} failed")
            fresh.append([slot, t0, h, admitted >= a.warmup, state])
            admitted += 1
            new += 1
        states = []
        for x in active:
            state = agent.check_xfer_state(x[2])
            if state == "ERR":
                raise SystemExit("NIXL: a transfer failed")
            states.append(state)
        done_at = time.perf_counter()
        keep = []
        for x, state in list(zip(active, states)) + [(f[:4], f[4]) for f in fresh]:
            if state == "DONE":
                to_release.append(x[2])
                free_slots.append(x[0])
                finished += 1
                if x[3]:
                    request_us.append((done_at - x[1]) * 1e6)
                    nbytes_timed += a.layers * n * a.block
                    ndescs += a.layers * n
            else:
                keep.append(x)
        active = keep
        if timed_since is not None:
            ticks += 1
            tick_us.append((done_at - t0) * 1e6)
    elapsed = time.perf_counter() - timed_since
    for h in to_release:
        agent.release_xfer_handle(h)
    parent.send("stop")
    notes = parent.recv()
    proc.join(timeout=10)
    print(
        f"KV NIXL ticks {ticks} tick_p50_us {quantile(tick_us, 0.5):.2f} "
        f"tick_p99_us {quantile(tick_us, 0.99):.2f} tick_max_us {quantile(tick_us, 1.0):.2f} "
        f"request_p50_us {quantile(request_us, 0.5):.2f} request_p99_us {quantile(request_us, 0.99):.2f} "
        f"requests {len(request_us)} gbps {nbytes_timed / elapsed / 1e9:.4f} "
        f"descs_per_s {ndescs / elapsed:.0f} notifications_at_target {notes}",
        flush=True,
    )


if __name__ == "__main__":
    main()
