"""Memory safety across the boundary: registered objects stay alive while registered;
deregistering memory in use, or a request after its memory is gone, raises."""
import gc
import weakref

import numpy as np
import pytest

import ferry
from conftest import loopback_agent, wait_done


class Owner:
    """An object with __array_interface__ whose death we can observe."""

    def __init__(self, n):
        self.array = np.zeros(n, dtype=np.uint8)
        self.__array_interface__ = self.array.__array_interface__


def test_last_reference_dropped_while_registered():
    a, b = loopback_agent(), loopback_agent()
    owner = Owner(1 << 20)
    probe = weakref.ref(owner)
    addr = owner.array.ctypes.data
    reg = b.register_memory(owner)
    del owner
    gc.collect()
    assert probe() is not None, "a registered object must be kept alive"
    # The memory is still valid: write into it from a peer, read it back.
    src = np.arange(1 << 20, dtype=np.uint64).view(np.uint8)[: 1 << 20].copy()
    a.register_memory(src)
    a.add_remote_agent(b.get_agent_metadata())
    x = a.initialize_xfer("WRITE", a.get_xfer_descs(src), [(addr, 1 << 20, 0)], b.name)
    a.transfer(x)
    wait_done(a, x)
    back = np.zeros(1 << 20, dtype=np.uint8)
    a.register_memory(back)
    y = a.initialize_xfer("READ", a.get_xfer_descs(back), [(addr, 1 << 20, 0)], b.name)
    a.transfer(y)
    wait_done(a, y)
    assert (back == src).all()
    a.release_xfer_handle(x)
    a.release_xfer_handle(y)
    b.deregister_memory(reg)
    del reg
    gc.collect()
    assert probe() is None, "deregistered memory must be let go"


def test_agent_dropped_with_registered_memory():
    arr = np.zeros(4096, dtype=np.uint8)
    probe = weakref.ref(Owner(4096))
    for _ in range(3):
        a = loopback_agent()
        a.register_memory([arr, Owner(4096)])
        del a
        gc.collect()
    assert probe() is None
    arr[:] = 1  # still ours


def test_deregister_in_use_is_refused():
    a, b = loopback_agent(), loopback_agent()
    src = np.ones(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    reg = a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("", a.get_xfer_descs(src))
    remote = a.prep_xfer_dlist(b.name, a.get_xfer_descs(dst))
    x = a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    with pytest.raises(ferry.NotAllowedError):
        a.deregister_memory(reg)  # the request pins it
    assert reg.is_registered
    a.transfer(x)
    wait_done(a, x)
    a.release_xfer_handle(x)
    a.deregister_memory(reg)
    with pytest.raises(ferry.NotFoundError):
        a.deregister_memory(reg)  # twice


def test_request_after_memory_is_gone_raises():
    a, b = loopback_agent(), loopback_agent()
    src = np.ones(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    reg = a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("", a.get_xfer_descs(src))
    remote = a.prep_xfer_dlist(b.name, a.get_xfer_descs(dst))
    a.deregister_memory(reg)
    del reg, src
    gc.collect()
    with pytest.raises(ferry.NotFoundError) as info:
        x = a.make_prepped_xfer("WRITE", local, [0], remote, [0])
        a.transfer(x)
    assert info.value.kind in ("StaleRegion", "NotFound")
    assert (dst == 0).all()
