"""Agent.alloc_memory / free_memory: memory the UCX backend allocates, seen from Python
through the buffer protocol, moved to and from, and freed only when nothing reaches it."""
import gc

import numpy as np
import pytest

import ferry
from conftest import loopback_agent, need_ucx, unique, wait_done

SIZE = 1 << 20


def ucx_agent(prefix):
    return ferry.Agent(unique(prefix), ferry.AgentConfig(backends=["UCX"]))


def test_a_backend_that_allocates_nothing_says_so():
    a = loopback_agent()
    with pytest.raises(ferry.NotSupportedError):
        a.alloc_memory(SIZE, backend="LOOPBACK")
    with pytest.raises(ferry.NotFoundError, match="NOSUCH"):
        a.alloc_memory(SIZE, backend="NOSUCH")


def test_bad_sizes_and_parts_get_typed_errors():
    need_ucx()
    a = ucx_agent("alloc-bad")
    with pytest.raises(ferry.InvalidParamError):
        a.alloc_memory(0)
    m = a.alloc_memory(4096)
    assert m.desc() == (m.addr, 4096, 0)
    assert m.desc(4000, 96) == (m.addr + 4000, 96, 0)
    with pytest.raises(ferry.InvalidParamError, match="outside the allocation"):
        m.desc(4000, 97)
    with pytest.raises(ferry.InvalidParamError):
        m.desc(1 << 63, 1 << 63)
    a.free_memory(m)


def test_views_keep_the_memory_and_free_waits_for_them():
    need_ucx()
    a = ucx_agent("alloc-views")
    m = a.alloc_memory(SIZE)
    assert (len(m), m.size, m.freed) == (SIZE, SIZE, False)
    view = m.view()
    assert (view.nbytes, view.readonly, view.format) == (SIZE, False, "B")
    arr = np.frombuffer(m.view(), dtype=np.uint8)
    arr[:] = np.arange(SIZE) % 253
    assert view[1000] == 1000 % 253
    with pytest.raises(ferry.NotAllowedError, match="export"):
        a.free_memory(m)
    del view, arr
    gc.collect()
    a.free_memory(m)
    assert m.freed
    with pytest.raises(ferry.NotFoundError, match="freed"):
        m.view()
    with pytest.raises(ferry.NotFoundError, match="freed"):
        a.free_memory(m)
    other = ucx_agent("alloc-other")
    n = other.alloc_memory(4096)
    with pytest.raises(ferry.MismatchError, match="another agent"):
        a.free_memory(n)
    other.free_memory(n)


def test_writes_and_reads_land_in_allocated_memory():
    need_ucx()
    a, b = ucx_agent("alloc-a"), ucx_agent("alloc-b")
    target = b.alloc_memory(SIZE)
    src = (np.arange(SIZE // 2) % 251).astype(np.uint8)
    back = np.zeros(SIZE // 2, dtype=np.uint8)
    reg = a.register_memory([src, back])
    a.add_remote_agent(b.get_agent_metadata())
    # 64 scattered 8 KiB blocks into the allocation, then the same blocks read back.
    order = np.random.default_rng(7).permutation(64)
    local = a.get_xfer_descs([(src.ctypes.data + i * 8192, 8192, 0) for i in range(64)])
    remote = a.get_xfer_descs([target.desc(int(j) * 8192, 8192) for j in order])
    x = a.initialize_xfer("WRITE", local, remote, b.name, b"in")
    a.transfer(x)
    wait_done(a, x)
    got = np.frombuffer(target.view(), dtype=np.uint8)
    for i, j in enumerate(order):
        assert (got[j * 8192:(j + 1) * 8192] == src[i * 8192:(i + 1) * 8192]).all(), i
    del got
    into = a.get_xfer_descs([(back.ctypes.data + i * 8192, 8192, 0) for i in range(64)])
    r = a.initialize_xfer("READ", into, remote, b.name)
    a.transfer(r)
    wait_done(a, r)
    assert (back == src).all()
    a.release_xfer_handle(x)
    a.release_xfer_handle(r)
    a.remove_remote_agent(b.name)
    a.deregister_memory(reg)
    b.free_memory(target)
    assert target.freed
