"""Torch tensors (when torch is installed) and __cuda_array_interface__ objects."""
import gc
import weakref

import numpy as np
import pytest

import ferry
from conftest import loopback_agent, need_ucx, unique, wait_done


class FakeCudaArray:
    """Stands for a CuPy/Numba device array: only the interface."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "strides": None, "version": 3}


def test_cuda_array_interface_is_vram():
    a = loopback_agent()
    descs = a.get_xfer_descs(FakeCudaArray(0x7000_0000, 4096))
    assert descs.mem_type == "VRAM" and descs.descs() == [(0x7000_0000, 4096, 0)]
    # No backend registers VRAM yet: a typed refusal, not a crash.
    with pytest.raises(ferry.NotSupportedError):
        a.register_memory(FakeCudaArray(0x7000_0000, 4096))
    with pytest.raises(ferry.MismatchError):
        a.get_xfer_descs(FakeCudaArray(0x7000_0000, 4096), "DRAM")


def test_cuda_array_interface_reaches_ucx_and_is_refused_with_the_reason():
    # The module is built with VRAM support; here (no GPU, Debian's UCX without CUDA)
    # UCX refuses the region and says why, naming what is missing.
    assert ferry.CUDA
    need_ucx()
    a = ferry.Agent(unique("cai-ucx"), ferry.AgentConfig(backends=["UCX"]))
    with pytest.raises(ferry.NotSupportedError) as refused:
        a.register_memory(FakeCudaArray(0x7000_0000, 4096))
    assert "CUDA" in str(refused.value) and "feature `cuda`" not in str(refused.value)


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch", reason="torch is not installed in this venv")
    a, b = loopback_agent(), loopback_agent()
    src = torch.arange(1024, dtype=torch.float32)
    dst = torch.zeros(1024, dtype=torch.float32)
    probe = weakref.ref(dst)
    a.register_memory(src)
    reg = b.register_memory([dst])
    assert reg.descs() == [(dst.data_ptr(), 4096, 0)]
    a.add_remote_agent(b.get_agent_metadata())
    x = a.initialize_xfer("WRITE", a.get_xfer_descs(src), b.get_xfer_descs(dst), b.name)
    a.transfer(x)
    wait_done(a, x)
    assert torch.equal(src, dst)
    a.release_xfer_handle(x)
    with pytest.raises(ferry.InvalidParamError, match="contiguous"):
        a.register_memory(torch.zeros(8, 8)[:, ::2])
    del dst
    gc.collect()
    assert probe() is not None
    b.deregister_memory(reg)
    del reg
    gc.collect()
    assert probe() is None
