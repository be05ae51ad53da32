"""The Python step of tools/gpu-check.sh: GPU memory through Ferry's Python module.

Two agents in this process, each with a UCX backend on the CUDA-capable libucp given
(--ucx-library). Device buffers are torch CUDA tensors where torch with CUDA is
importable, otherwise device memory allocated through the driver (ctypes on
libcuda.so.1) and handed over as __cuda_array_interface__ objects, the way CuPy or
Numba arrays arrive. Both register as VRAM; 1 MiB x 32 WRITE and READ are checked byte
for byte and timed beside cuMemcpyDtoD of the same bytes. Prints PASS/FAIL lines;
exit status 0 only when everything passed.
"""
import argparse
import ctypes
import os
import sys
import time

BLOCK, COUNT = 1 << 20, 32
TOTAL = BLOCK * COUNT


class Driver:
    """The few CUDA driver calls the check needs, through ctypes."""

    def __init__(self, dev):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self._ok(self.cu.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._ok(self.cu.cuDeviceGet(ctypes.byref(device), dev), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self._ok(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        self._ok(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def _ok(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def alloc(self, n):
        ptr = ctypes.c_uint64()
        self._ok(self.cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n)), "cuMemAlloc")
        return ptr.value

    def htod(self, dst, data):
        self._ok(self.cu.cuMemcpyHtoD_v2(ctypes.c_uint64(dst), data, ctypes.c_size_t(len(data))), "cuMemcpyHtoD")

    def dtoh(self, src, n):
        out = ctypes.create_string_buffer(n)
        self._ok(self.cu.cuMemcpyDtoH_v2(out, ctypes.c_uint64(src), ctypes.c_size_t(n)), "cuMemcpyDtoH")
        return out.raw

    def dtod(self, dst, src, n):
        self._ok(self.cu.cuMemcpyDtoD_v2(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(n)), "cuMemcpyDtoD")


class DeviceArray:
    """Device memory as CuPy or Numba would hand it over: only the interface."""

    def __init__(self, ptr, nbytes, dev):
        self.ptr, self.nbytes, self.dev = ptr, nbytes, dev
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "strides": None, "version": 3}


def wait(agent, handle, what, limit_s=30.0):
    deadline = time.monotonic() + limit_s
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR" or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: transfer ended as {state}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ucx-library", required=True)
    parser.add_argument("--dev", type=int, default=0)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    import ferry

    print(f"ferry {ferry.__version__} from {os.path.dirname(ferry.__file__)}, CUDA support {ferry.CUDA}")
    if not ferry.CUDA:
        print("FAIL  python: this ferry module is built without VRAM support (feature cuda)")
        return 1
    drv = Driver(args.dev)
    payload = bytes((i * 7 + (i >> 12)) & 0xFF for i in range(TOTAL))
    try:
        import torch

        use_torch = torch.cuda.is_available()
    except ImportError:
        use_torch = False
    if use_torch:
        kind = f"torch {torch.__version__} CUDA tensors"
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(f"cuda:{args.dev}")
        dst = torch.zeros(TOTAL, dtype=torch.uint8, device=f"cuda:{args.dev}")
        back = torch.zeros(TOTAL, dtype=torch.uint8, device=f"cuda:{args.dev}")
        addr = lambda t: t.data_ptr()  # noqa: E731
        read = lambda t: bytes(t.cpu().numpy().tobytes())  # noqa: E731
        clear = lambda t: t.zero_()  # noqa: E731
    else:
        kind = "__cuda_array_interface__ objects (driver allocations; torch with CUDA not importable)"
        src, dst, back = (DeviceArray(drv.alloc(TOTAL), TOTAL, args.dev) for _ in range(3))
        drv.htod(src.ptr, payload)
        addr = lambda a: a.ptr  # noqa: E731
        read = lambda a: drv.dtoh(a.ptr, TOTAL)  # noqa: E731
        clear = lambda a: drv.htod(a.ptr, bytes(TOTAL))  # noqa: E731
        clear(dst)
        clear(back)
    print(f"buffers: {kind}")
    params = {"ucx_library": args.ucx_library}
    a = ferry.Agent("gpu-py-a", ferry.AgentConfig(backends=[]))
    b = ferry.Agent("gpu-py-b", ferry.AgentConfig(backends=[]))
    a.create_backend("UCX", params)
    b.create_backend("UCX", params)
    a.register_memory([src, back])
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    # 32 blocks of 1 MiB, block i of ours to block 31 - i of theirs (no merging).
    local = [(addr(src) + i * BLOCK, BLOCK, args.dev) for i in range(COUNT)]
    local_back = [(addr(back) + i * BLOCK, BLOCK, args.dev) for i in range(COUNT)]
    remote = [(addr(dst) + (COUNT - 1 - i) * BLOCK, BLOCK, args.dev) for i in range(COUNT)]
    to_descs = lambda agent, d: agent.get_xfer_descs(d, "VRAM")  # noqa: E731
    write = a.initialize_xfer("WRITE", to_descs(a, local), to_descs(a, remote), b.name)
    readx = a.initialize_xfer("READ", to_descs(a, local_back), to_descs(a, remote), b.name)
    failed = 0
    times = {}
    for name, handle in (("write", write), ("read", readx)):
        samples = []
        for _ in range(args.iters + 1):
            t0 = time.perf_counter()
            a.transfer(handle)
            wait(a, handle, name)
            samples.append(time.perf_counter() - t0)
        samples = sorted(samples[1:])
        times[name] = samples[len(samples) // 2]
    landed = read(dst)
    want = b"".join(payload[(COUNT - 1 - j) * BLOCK:][:BLOCK] for j in range(COUNT))
    came_back = read(back)
    plain = []
    for _ in range(args.iters + 1):
        t0 = time.perf_counter()
        drv.dtod(addr(back), addr(src), TOTAL)
        plain.append(time.perf_counter() - t0)
    plain = sorted(plain[1:])[len(plain[1:]) // 2]
    for name, ok in (("write", landed == want), ("read", came_back == payload)):
        gbps = TOTAL / times[name] / 1e9
        verdict = "PASS" if ok else "FAIL"
        failed += not ok
        print(f"{verdict}  python VRAM {name} 1 MiB x 32, 2 agents, UCX: {gbps:7.2f} GB/s "
              f"(cuMemcpyDtoD of 32 MiB: {TOTAL / plain / 1e9:7.2f} GB/s)")
    a.release_xfer_handle(write)
    a.release_xfer_handle(readx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
