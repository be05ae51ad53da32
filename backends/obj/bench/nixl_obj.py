#!/usr/bin/env python3
"""NIXL baseline for Ferry's OBJ benchmark: COUNT objects of BLOCK bytes each, one
request per iteration (WRITE = PUT of every object, READ = GET of every object),
NIXL's OBJ plugin (AWS SDK C++) against an S3 endpoint, DRAM on the local side.

Run through nixl-compare.sh (which installs NIXL 1.5.1 from PyPI into a throwaway
venv). Prints one line per op: `nixl OP BLOCK x COUNT: GB/s S (ITERS iters, median
request MS ms)`, GB/s over all timed iterations.

    python3 nixl_obj.py --endpoint http://127.0.0.1:9000 --bucket b --block 1048576 \
        --count 32 --iters 10 --warmup 2 [--param crtMinLimit=...]

The buffer is 2 MiB aligned and every page written once, as Ferry's benchmark does.
"""
import argparse
import os
import statistics
import time

import numpy as np

ALIGN = 2 << 20


def make_agent(name, params):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the nixl-cu12 wheel alone
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("OBJ", params)
    return agent


def filled_buffer(length):
    raw = np.empty(length + ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    buf = raw[offset:offset + length]
    buf[:] = np.random.default_rng(1).integers(0, 256, length, dtype=np.uint8)
    return raw, buf


def run_op(agent, name, op, local, remote, iters, warmup):
    durations = []
    for i in range(warmup + iters):
        started = time.perf_counter()
        handle = agent.initialize_xfer(op, local, remote, name, backends=["OBJ"])
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        if state == "ERR":
            raise SystemExit(f"nixl {op} failed")
        if i >= warmup:
            durations.append(time.perf_counter() - started)
    return durations


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--block", type=int, default=1 << 20)
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ops", default="WRITE,READ")
    p.add_argument("--prefix", default="nixl-bench")
    p.add_argument("--param", action="append", default=[], help="KEY=VALUE for the OBJ backend")
    a = p.parse_args()

    scheme, _, host = a.endpoint.partition("://")
    params = {
        "endpoint_override": a.endpoint,
        "scheme": scheme or "http",
        "bucket": a.bucket,
        "region": os.environ.get("AWS_REGION", "us-east-1"),
        "access_key": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        "secret_key": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
        "use_virtual_addressing": "false",
    }
    for kv in a.param:
        k, _, v = kv.partition("=")
        params[k] = v
    name = f"nixl-obj-{os.getpid()}"
    agent = make_agent(name, params)
    length = a.block * a.count
    _raw, buf = filled_buffer(length)
    base = buf.ctypes.data
    agent.register_memory([(base, length, 0, "")], "DRAM", backends=["OBJ"])
    objects = [(0, a.block, i, f"{a.prefix}/{a.block}/{i}") for i in range(a.count)]
    agent.register_memory(objects, "OBJ", backends=["OBJ"])
    local = agent.get_xfer_descs([(base + i * a.block, a.block, 0) for i in range(a.count)], "DRAM")
    remote = agent.get_xfer_descs([(0, a.block, i) for i in range(a.count)], "OBJ")
    for op in a.ops.split(","):
        d = run_op(agent, name, op, local, remote, a.iters, a.warmup)
        gbps = length * len(d) / sum(d) / 1e9
        print(f"nixl {op} {a.block} x {a.count}: GB/s {gbps:.3f} ({len(d)} iters, "
              f"median request {statistics.median(d) * 1e3:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
