#!/usr/bin/env python3
"""Ferry from Python vs NIXL from Python, side by side in one run, on one UCX library.

Each measurement runs in a fresh child process per system (two agents in the child:
an initiator and a target, both on UCX; the target with a progress thread, the
initiator progressing in its own calls unless --initiator-prog-thread), alternating
NIXL, Ferry, NIXL, Ferry … for --rounds rounds; the table gives the median over rounds
of each child's median. Both children get the same environment (UCX_* variables
included) and Ferry's UCX backend loads the libucp bundled in the nixl wheel, so both
sides run the same UCX build.

  python compare_nixl.py                 # NIXL, ferry.Agent, ferry.nixl (needs the nixl wheel)
  python compare_nixl.py --systems ferry # Ferry alone

Systems: nixl (NIXL's wheel), ferry (Ferry's own API, ferry.Agent) and ferry-nixl
(NIXL's API on Ferry, ferry.nixl: NIXL's calls, unchanged, through the compatibility
layer — what code switched over with the ferry-nixl shim runs).

Cases:
  control  one request of 1,024 prepared descriptors (64 B each, scattered: no merging):
           make_prepped_xfer, transfer (post), first check_xfer_state, release, each
           timed from Python; plus Ferry's Batch doing make+post in one flush, and
           16 such requests made+posted in one flush (per request).
  loop     a made request of 1,024 × 64 B or 1,024 × 4 KiB descriptors, reposted and
           polled to DONE, back to back: µs per iteration and GB/s.
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

N = 1024


def _installed(dist):
    from importlib import metadata
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def ucx_lib_of_nixl():
    try:
        import nixl_cu12 as pkg  # noqa: F401
        base = os.path.dirname(pkg.__file__) + ".libs"
    except ImportError:
        try:
            import nixl_cu13 as pkg  # noqa: F401
            base = os.path.dirname(pkg.__file__) + ".libs"
        except ImportError:
            return None
    hits = sorted(glob.glob(os.path.join(base, "libucp*.so*")))
    return hits[0] if hits else None


# --------------------------------------------------------------------- the two sides

#: Extra UCX backend parameters for Ferry's sides (--ferry-ucx-param KEY=VALUE).
FERRY_UCX_EXTRA = {}


def ferry_ucx_params(ucx_lib):
    params = dict(FERRY_UCX_EXTRA)
    if ucx_lib:
        params["ucx_library"] = ucx_lib
    return params


class Nixl:
    name = "nixl"

    def __init__(self, tag, init_thread):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError:  # the CUDA-12 build alone, without the `nixl` meta package
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        self.init_thread = init_thread
        self.init = nixl_agent(f"nixl-init-{tag}",
                               nixl_agent_config(enable_prog_thread=init_thread, backends=["UCX"]))
        self.target = nixl_agent(f"nixl-target-{tag}",
                                 nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))

    def config(self):
        from importlib import metadata
        versions = {d: metadata.version(d) for d in ("nixl", "nixl-cu12", "nixl-cu13")
                    if _installed(d)}
        return {"wheel": versions, "backend": "UCX", "initiator enable_prog_thread": self.init_thread,
                "target enable_prog_thread": True, "params": self.init.get_backend_params("UCX")}


class Ferry:
    name = "ferry"

    def __init__(self, tag, init_thread, ucx_lib):
        import ferry
        params = {"UCX": ferry_ucx_params(ucx_lib)}
        self.ferry = ferry
        self.init_thread = init_thread
        self.init = ferry.Agent(f"ferry-init-{tag}", ferry.AgentConfig(
            backends=["UCX"], enable_prog_thread=init_thread, backend_params=params))
        self.target = ferry.Agent(f"ferry-target-{tag}", ferry.AgentConfig(
            backends=["UCX"], enable_prog_thread=True, backend_params=params))

    def config(self):
        return {"module": self.ferry.__version__, "backend": "UCX",
                "initiator enable_prog_thread": self.init_thread, "target enable_prog_thread": True,
                "params": self.init.get_backend_params("UCX")}


class FerryNixl:
    """NIXL's Python API on Ferry (ferry.nixl, what the ferry-nixl shim gives code that
    imports nixl): the same calls as the NIXL side, through the compatibility layer."""

    name = "ferry-nixl"

    def __init__(self, tag, init_thread, ucx_lib):
        import ferry
        from ferry.nixl._api import nixl_agent, nixl_agent_config
        self.ferry = ferry
        self.init_thread = init_thread

        def make(name, thread):
            agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=thread, backends=[]))
            agent.create_backend("UCX", ferry_ucx_params(ucx_lib))
            return agent

        self.init = make(f"fnixl-init-{tag}", init_thread)
        self.target = make(f"fnixl-target-{tag}", True)

    def config(self):
        return {"module": f"ferry.nixl {self.ferry.__version__}", "backend": "UCX",
                "initiator enable_prog_thread": self.init_thread, "target enable_prog_thread": True,
                "params": self.init.get_backend_params("UCX")}


SYSTEMS = {"nixl": Nixl, "ferry": Ferry, "ferry-nixl": FerryNixl}


def setup(side, size):
    import numpy as np
    a, b = side.init, side.target
    src = np.zeros(2 * N * size, dtype=np.uint8)
    dst = np.zeros(2 * N * size, dtype=np.uint8)
    src[:] = 7
    # The same (addr, len, dev, name) form on both sides (nixl's wheel does not take a
    # 1-D NumPy array as memory; Ferry does, but the form is shared here).
    keep = (a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"),
            b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    # Every other slot of `size` bytes: no two descriptors are adjacent, nothing merges.
    rows = lambda base: np.array([[base + 2 * i * size, size, 0] for i in range(N)], dtype=np.uint64)
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows(src.ctypes.data), "DRAM")
    remote = a.prep_xfer_dlist(b.name, rows(dst.ctypes.data), "DRAM")
    rng = np.random.default_rng(7)
    li = np.arange(N, dtype=np.int32)
    ri = rng.permutation(N).astype(np.int32)
    # Kept for the child's life: the regions stay registered, so their addresses must
    # not be reused by the next case's arrays (Ferry refuses overlapping registrations).
    _KEEP.append((src, dst, keep))
    return (src, dst, keep), local, remote, li, ri


_KEEP = []


def wait(a, h):
    while True:
        s = a.check_xfer_state(h)
        if s == "DONE":
            return
        if s != "PROC":
            raise RuntimeError(f"transfer state {s}")


def control(side, iters):
    a = side.init
    mem, local, remote, li, ri = setup(side, 64)
    ns = time.perf_counter_ns
    rows = {"make": [], "post": [], "check": [], "release": [], "make+post+check": []}
    for i in range(iters + 20):
        t0 = ns()
        h = a.make_prepped_xfer("WRITE", local, li, remote, ri)
        t1 = ns()
        a.transfer(h)
        t2 = ns()
        a.check_xfer_state(h)
        t3 = ns()
        wait(a, h)
        t4 = ns()
        a.release_xfer_handle(h)
        t5 = ns()
        if i >= 20:  # warm-up
            rows["make"].append(t1 - t0)
            rows["post"].append(t2 - t1)
            rows["check"].append(t3 - t2)
            rows["release"].append(t5 - t4)
            rows["make+post+check"].append(t3 - t0)
    out = {k: statistics.median(v) / 1e3 for k, v in rows.items()}
    if side.name == "ferry":
        out.update(ferry_batch(side, local, remote, li, ri, iters))
    return out


def ferry_batch(side, local, remote, li, ri, iters):
    import numpy as np
    ferry = side.ferry
    a = side.init
    ns = time.perf_counter_ns
    b = ferry.Batch(64)
    chk = ferry.Batch(64)
    rel = ferry.Batch(64)
    one, many = [], []
    idx1, idx2 = li.astype(np.uint32), ri.astype(np.uint32)
    k = 16
    L = np.tile(idx1, (k, 1))
    R = np.tile(idx2, (k, 1))
    for i in range(iters + 20):
        # One request: make+post in one flush, first check in a second flush.
        b.clear()
        t0 = ns()
        b.make("WRITE", local, idx1, remote, idx2, post=True)
        a.flush(b)
        h = b.handles()[:1]
        chk.clear()
        chk.check_many(h)
        a.flush(chk)
        t1 = ns()
        b.raise_first()
        for x in h:
            wait(a, int(x))
        rel.clear()
        rel.release_many(h)
        a.flush(rel)
        if i >= 20:
            one.append(t1 - t0)
    for i in range(max(iters // 8, 10) + 5):
        # 16 requests in one flush.
        b.clear()
        t2 = ns()
        made = b.make_many("WRITE", local, L, remote, R)
        a.flush(b)
        hs = b.handles()[made]
        chk.clear()
        chk.check_many(hs)
        a.flush(chk)
        t3 = ns()
        b.raise_first()
        for x in hs:
            wait(a, int(x))
        rel.clear()
        rel.release_many(hs)
        a.flush(rel)
        if i >= 5:
            many.append((t3 - t2) / k)
    return {"batch make+post+check": statistics.median(one) / 1e3,
            "batch ×16 make+post+check, per request": statistics.median(many) / 1e3}


def loop(side, size, iters):
    a = side.init
    mem, local, remote, li, ri = setup(side, size)
    h = a.make_prepped_xfer("WRITE", local, li, remote, ri)
    ns = time.perf_counter_ns
    times = []
    for i in range(iters + 20):
        t0 = ns()
        a.transfer(h)
        wait(a, h)
        if i >= 20:
            times.append(ns() - t0)
    a.release_xfer_handle(h)
    us = statistics.median(times) / 1e3
    return {"us_per_iter": us, "GB/s": N * size / (us * 1e3)}


def child(system, iters, init_thread, ucx_lib):
    tag = f"{os.getpid()}"
    side = Nixl(tag, init_thread) if system == "nixl" else SYSTEMS[system](tag, init_thread, ucx_lib)
    res = {"config": side.config(), "control": control(side, iters)}
    for size in (64, 4096):
        res[f"loop {size} B"] = loop(side, size, iters)
    print(json.dumps(res), flush=True)
    # Skip interpreter teardown: the nixl-cu12 1.5.1 wheel segfaults there (exit 139)
    # after its work is done; the same exit for both systems.
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="nixl,ferry,ferry-nixl",
                    help="comma-separated: nixl (NIXL's wheel), ferry (ferry.Agent), "
                         "ferry-nixl (NIXL's API on Ferry, ferry.nixl)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--ucx-lib", default=None, help="libucp for Ferry (default: the nixl wheel's)")
    ap.add_argument("--initiator-prog-thread", action="store_true",
                    help="give the initiator a progress thread too (the target always has one)")
    ap.add_argument("--ferry-ucx-param", action="append", default=[], metavar="KEY=VALUE",
                    help="a UCX backend parameter for Ferry's sides (repeatable), e.g. "
                         "tcp_seg_bytes=ucx")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for kv in args.ferry_ucx_param:
        key, _, value = kv.partition("=")
        FERRY_UCX_EXTRA[key] = value
    if args.child:
        child(args.child, args.iters, args.initiator_prog_thread, args.ucx_lib)
        return
    systems = args.systems.split(",")
    ucx_lib = args.ucx_lib or ucx_lib_of_nixl()
    results = {s: [] for s in systems}
    for r in range(args.rounds):
        for s in (systems if r % 2 == 0 else systems[::-1]):
            cmd = [sys.executable, __file__, "--child", s, "--iters", str(args.iters)]
            if args.initiator_prog_thread:
                cmd.append("--initiator-prog-thread")
            if ucx_lib:
                cmd += ["--ucx-lib", ucx_lib]
            for kv in args.ferry_ucx_param:
                cmd += ["--ferry-ucx-param", kv]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                sys.exit(f"{s} child failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
            results[s].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"UCX library: {ucx_lib or 'system libucp.so.0'}")
    print("UCX_* environment: " + (" ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                             if k.startswith("UCX_")) or "(none)"))
    for s in systems:
        print(f"{s} config: {json.dumps(results[s][0]['config'])}")
    print(f"\nmedian of {args.rounds} rounds (each the median of {args.iters} iterations)\n")
    rows = []
    for case in ("control",):
        keys = []
        for s in systems:
            for k in results[s][0][case]:
                if k not in keys:
                    keys.append(k)
        for k in keys:
            rows.append((f"control: {k} (µs)", {s: statistics.median(r[case][k] for r in results[s])
                                                for s in systems if k in results[s][0][case]}))
    for size in (64, 4096):
        case = f"loop {size} B"
        for k in ("us_per_iter", "GB/s"):
            rows.append((f"loop 1024 × {size} B: {k}", {s: statistics.median(r[case][k] for r in results[s])
                                                        for s in systems}))
    w = max(len(r[0]) for r in rows)
    others = [s for s in systems if s != "nixl"] if "nixl" in systems else []
    print(f"{'case':<{w}}  " + "  ".join(f"{s:>10}" for s in systems)
          + "".join(f"  {'nixl/' + s:>16}" for s in others))
    for name, vals in rows:
        cells = "  ".join(f"{vals[s]:>10.2f}" if s in vals else f"{'—':>10}" for s in systems)
        ratios = ""
        for s in others:
            if "nixl" in vals and s in vals:
                n, f = vals["nixl"], vals[s]
                ratios += f"  {(f / n if 'GB/s' in name else n / f):>15.2f}×"
            else:
                ratios += f"  {'—':>16}"
        print(f"{name:<{w}}  {cells}{ratios}")


if __name__ == "__main__":
    main()
