#!/usr/bin/env python3
"""NIXL's side of benches/defaults-compare.sh: NIXL 1.5.1 as a newcomer would use it.

Two processes (started by the script, each pinned there with taskset), one target and
one initiator, each an agent made by `nixl_agent(name)` with NIXL's default
configuration: the UCX backend NIXL creates by default (its default parameters), NIXL's
progress thread (on by default), NIXL's bundled UCX. They meet through files in a
directory both can see (--dir; network namespaces share the filesystem):

    target.md / target.addr   the target's metadata blob, its buffer's address and length
    initiator.md              the initiator's metadata blob
    target.ready              the target has loaded the initiator's metadata
    done                      the initiator has finished (the target leaves)

What the initiator times mirrors `ferry bench xfer` (tools/src/xfer/sweep.rs, one
worker, prepared request, contiguous layout, one descriptor): per operation the request
is made once (`initialize_xfer`), then --warmup untimed and --iters timed iterations of
`transfer` + `check_xfer_state` until DONE (one request in flight); GB/s is 1e9 bytes per
second over the timed iterations' wall time, as Ferry's `gbps` column.

Buffers mirror Ferry's (tools/src/xfer/buffer.rs: `vec![0u8; len]`, i.e. glibc's
calloc(len, 1), then one write per 4 KiB page): the same calloc here, then every byte
written once (memset). Length: the block, at least 4 KiB (Ferry's default --buffer).

    defaults_nixl.py target    --dir D --block B
    defaults_nixl.py initiator --dir D --block B --ops WRITE,READ --iters N --warmup W

The initiator prints one line per operation:
    NIXL <OP> block <B> iters <N> warmup <W> seconds <S> gbps <G>
and both print a `config:` line (agent, backend parameters, libucp loaded, buffer
address modulo 4096).
"""
import argparse
import ctypes
import json
import os
import sys
import time

try:
    from nixl._api import nixl_agent
except ImportError:  # the nixl-cu12 wheel alone, without the "nixl" meta-package
    from nixl_cu12._api import nixl_agent

POLL_S = 0.002
WAIT_S = 60.0


def wait_for(path, why):
    """Wait (bounded) until `path` exists."""
    until = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > until:
            sys.exit(f"NIXL: timed out waiting for {why} ({path})")
        time.sleep(POLL_S)


def publish(path, data):
    """Write `data` to `path` atomically (the reader never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def buffer(block):
    """Ferry's allocation: calloc(len, 1) from glibc, every page written."""
    length = max(block, 4096)
    libc = ctypes.CDLL(None)
    libc.calloc.restype = ctypes.c_void_p
    libc.calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    addr = libc.calloc(length, 1)
    if not addr:
        sys.exit(f"NIXL: calloc({length}) failed")
    ctypes.memset(addr, 0, length)
    return addr, length


def libucp():
    """The libucp this process loaded (NIXL's bundled one) and its version string."""
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.split()[-1] if len(line.split()) >= 6 else ""
            if "libucp" in os.path.basename(name):
                path = name
                break
    if path is None:
        return "libucp not loaded?", ""
    try:
        ucp = ctypes.CDLL(path)
        ucp.ucp_get_version_string.restype = ctypes.c_char_p
        return path, ucp.ucp_get_version_string().decode()
    except OSError as e:
        return path, f"version unknown ({e})"


def config_line(agent, role, addr, length):
    path, version = libucp()
    # The init parameters given (none: the default) and the plugin's defaults for them.
    params = agent.get_backend_params("UCX") if "UCX" in agent.backends else {}
    defaults = agent.get_plugin_params("UCX")
    ucx_env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    print(
        f"config: NIXL {role} agent={agent.name} backends={list(agent.backends)} "
        f"libucp={path} ucx_version={version} buffer_len={length} "
        f"buffer_addr_mod_4096={addr % 4096} cpus={sorted(os.sched_getaffinity(0))} "
        f"ucx_env={json.dumps(ucx_env, sort_keys=True)} "
        f"ucx_backend_params={json.dumps(params, sort_keys=True)} "
        f"ucx_plugin_defaults={json.dumps(defaults, sort_keys=True)}",
        flush=True,
    )


def target(args):
    agent = nixl_agent("nixl-defaults-target")
    addr, length = buffer(args.block)
    agent.register_memory([(addr, length, 0, "")], "DRAM")
    config_line(agent, "target", addr, length)
    publish(os.path.join(args.dir, "target.md"), agent.get_agent_metadata())
    publish(os.path.join(args.dir, "target.addr"), f"{addr} {length}".encode())
    wait_for(os.path.join(args.dir, "initiator.md"), "the initiator's metadata")
    agent.add_remote_agent(read_bytes(os.path.join(args.dir, "initiator.md")))
    publish(os.path.join(args.dir, "target.ready"), b"1")
    # NIXL's progress thread (on by default) progresses this agent: just wait.
    done = os.path.join(args.dir, "done")
    until = time.monotonic() + args.max_seconds
    while not os.path.exists(done):
        if time.monotonic() > until:
            sys.exit("NIXL target: the initiator never finished")
        time.sleep(0.01)
    del agent


def initiator(args):
    agent = nixl_agent("nixl-defaults-initiator")
    addr, length = buffer(args.block)
    agent.register_memory([(addr, length, 0, "")], "DRAM")
    config_line(agent, "initiator", addr, length)
    wait_for(os.path.join(args.dir, "target.addr"), "the target's metadata")
    remote_md = read_bytes(os.path.join(args.dir, "target.md"))
    remote_addr = int(read_bytes(os.path.join(args.dir, "target.addr")).split()[0])
    name = agent.add_remote_agent(remote_md)
    if isinstance(name, bytes):
        name = name.decode()
    publish(os.path.join(args.dir, "initiator.md"), agent.get_agent_metadata())
    wait_for(os.path.join(args.dir, "target.ready"), "the target to load our metadata")

    local = agent.get_xfer_descs([(addr, args.block, 0)], "DRAM")
    remote = agent.get_xfer_descs([(remote_addr, args.block, 0)], "DRAM")
    try:
        for op in args.ops.split(","):
            handle = agent.initialize_xfer(op, local, remote, name)
            started = time.perf_counter()
            for it in range(args.warmup + args.iters):
                if it == args.warmup:
                    started = time.perf_counter()
                state = agent.transfer(handle)
                while state != "DONE":
                    if state == "ERR":
                        sys.exit(f"NIXL {op} block {args.block}: transfer failed")
                    state = agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - started
            agent.release_xfer_handle(handle)
            gbps = args.block * args.iters / elapsed / 1e9
            print(
                f"NIXL {op} block {args.block} iters {args.iters} warmup {args.warmup} "
                f"seconds {elapsed:.4f} gbps {gbps:.4f}",
                flush=True,
            )
    finally:
        publish(os.path.join(args.dir, "done"), b"1")
    # Let the target see "done" and leave first, as Ferry's target lingers.
    time.sleep(0.2)
    del agent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=["target", "initiator"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=300.0,
                    help="target: give up waiting for the initiator after this long")
    args = ap.parse_args()
    (target if args.role == "target" else initiator)(args)


if __name__ == "__main__":
    main()
