#!/usr/bin/env python3
"""NIXL's side of the metadata comparison (Ferry's: FERRY_BENCH_UCX_METADATA=N with the
UCX benchmark, `ferry_benches::ucx_md`): N regions of 1 MiB, 2 MiB apart, in one untouched
anonymous mapping, registered one by one with two NIXL agents' UCX backends in one
process; the size of `get_agent_metadata()`, its median time over every call, the
first one included (encode), and the median
time of `add_remote_agent` on the other agent (load; `remove_remote_agent` between
iterations, not timed).

    UCX_NET_DEVICES=lo python3 nixl_md.py --regions 15000
"""
import argparse
import ctypes
import mmap
import time

REGION = 1 << 20
STRIDE = 2 << 20


def reserve(length):
    """An untouched anonymous MAP_NORESERVE mapping (as Ferry's side), never unmapped."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    map_noreserve = 0x4000  # Linux
    addr = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_noreserve, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {length} bytes")
    return addr


def timed(fn, min_seconds):
    times = []
    started = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - started < min_seconds:
        times.append(fn())
    times.sort()
    return times[len(times) // 2], len(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--regions", type=int, default=15000)
    ap.add_argument("--err-mode", default="none")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the nixl-cu12 wheel alone, without the "nixl" meta-package
        from nixl_cu12._api import nixl_agent, nixl_agent_config

    def agent(name):
        config = nixl_agent_config(enable_prog_thread=False, backends=[])
        a = nixl_agent(name, config)
        a.create_backend("UCX", {"ucx_error_handling_mode": args.err_mode})
        return a

    a, b = agent("nixl-md-a"), agent("nixl-md-b")
    base = reserve(args.regions * STRIDE)
    regs = a.register_memory([(base + i * STRIDE, REGION, 0, "") for i in range(args.regions)], "DRAM")
    first = []

    def encode():
        # Every call timed, the first one too (as Ferry's side); its blob is loaded below.
        t0 = time.perf_counter()
        md = a.get_agent_metadata()
        took = time.perf_counter() - t0
        if not first:
            first.append(md)
        del md
        return took

    def load():
        t0 = time.perf_counter()
        name = b.add_remote_agent(blob)
        took = time.perf_counter() - t0
        b.remove_remote_agent(name.decode() if isinstance(name, bytes) else name)
        return took

    enc, n1 = timed(encode, args.seconds)
    blob = first[0]
    ld, n2 = timed(load, args.seconds)
    print(f"NIXL METADATA regions {args.regions} bytes {len(blob)} encode median {enc * 1e6:.1f} us "
          f"load median {ld * 1e6:.1f} us ({min(n1, n2)} iters)", flush=True)
    a.deregister_memory(regs)
    import os
    os._exit(0)  # the nixl-cu12 wheel can crash at interpreter exit


if __name__ == "__main__":
    main()
