"""The NIXL-style flow on UCX between two processes (metadata by P2P), and the batch
API across them."""
import multiprocessing as mp

import numpy as np
import pytest

import ferry
from conftest import need_ucx, unique, wait_done, wait_for

SIZE = 1 << 20
BLOCK = 4096


def target(name, to_parent, from_parent):
    """The target process: registers a buffer, serves its metadata by P2P, waits for
    the initiator's notifications, checks what it received."""
    try:
        agent = ferry.Agent(name, ferry.AgentConfig(backends=["UCX"], enable_listen_thread=True))
        buf = np.zeros(SIZE, dtype=np.uint8)
        buf[SIZE // 2:] = 0xAB  # the half the initiator reads
        reg = agent.register_memory(buf)
        to_parent.put((agent.listen_addr, buf.ctypes.data))
        initiator = from_parent.get(timeout=30)
        wait_for(lambda: agent.check_remote_xfer_done(initiator, b"written"), timeout_s=30,
                 what="the initiator's notification")
        expect = (np.arange(SIZE // 2) % 251).astype(np.uint8)
        ok = bool((buf[:SIZE // 2] == expect).all())
        to_parent.put(("checked", ok))
        from_parent.get(timeout=30)  # the initiator is done with our memory
        agent.deregister_memory(reg)
        to_parent.put(("bye", True))
    except BaseException as e:  # report, so the parent fails with the cause
        to_parent.put(("error", repr(e)))


@pytest.fixture
def ucx_target():
    need_ucx()
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    name = unique("ucx-target")
    proc = ctx.Process(target=target, args=(name, to_parent, from_parent))
    proc.start()
    try:
        first = to_parent.get(timeout=60)
        assert first[0] != "error", first
        yield name, first, to_parent, from_parent
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0


def test_ucx_two_processes_nixl_flow(ucx_target):
    name, ((host, port), remote_addr), to_parent, from_parent = ucx_target
    agent = ferry.Agent(unique("ucx-init"), ferry.AgentConfig(backends=["UCX"], enable_listen_thread=True))
    from_parent.put(agent.name)
    assert agent.get_backends() == ["UCX"]
    src = (np.arange(SIZE // 2) % 251).astype(np.uint8)
    back = np.zeros(SIZE // 2, dtype=np.uint8)
    agent.register_memory([src, back])

    agent.fetch_remote_metadata(name, host, port)
    wait_for(lambda: agent.check_remote_metadata(name), what="the target's metadata")
    agent.make_connection(name)

    n = SIZE // 2 // BLOCK
    local = agent.prep_xfer_dlist("", [(src.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(n)])
    remote = agent.prep_xfer_dlist(name, [(remote_addr + i * BLOCK, BLOCK, 0) for i in range(n)])
    # Batch: 4 requests of n/4 blocks each, made and posted in one flush.
    batch = agent.batch()
    idx = np.arange(n, dtype=np.uint32).reshape(4, n // 4)
    made = batch.make_many("WRITE", local, idx, remote, idx)
    agent.flush(batch)
    batch.raise_first()
    handles = batch.handles()[made]
    for h in handles:
        wait_done(agent, int(h))
    # Every request is done, so a standalone notification now follows the data.
    agent.send_notif(name, b"written")
    tag, ok = to_parent.get(timeout=30)
    assert (tag, ok) == ("checked", True)

    # Read the target's second half (NIXL's initialize_xfer path).
    x = agent.initialize_xfer("READ", agent.get_xfer_descs(back),
                              [(remote_addr + SIZE // 2, SIZE // 2, 0)], name)
    assert agent.transfer(x) in ("DONE", "PROC")
    wait_done(agent, x)
    assert (back == 0xAB).all()
    tel = agent.get_xfer_telemetry(x)
    assert tel["totalBytes"] == SIZE // 2
    agent.release_xfer_handle(x)
    rel = agent.batch()
    rel.release_many(handles)
    agent.flush(rel)
    rel.raise_first()
    from_parent.put("done")
    assert to_parent.get(timeout=30) == ("bye", True)


def test_ucx_notification_attached_to_transfer(ucx_target):
    name, ((host, port), remote_addr), to_parent, from_parent = ucx_target
    agent = ferry.Agent(unique("ucx-notif"), ferry.AgentConfig(backends=["UCX"], enable_listen_thread=True))
    from_parent.put(agent.name)
    src = (np.arange(SIZE // 2) % 251).astype(np.uint8)
    agent.register_memory(src)
    agent.fetch_remote_metadata(name, host, port)
    wait_for(lambda: agent.check_remote_metadata(name), what="the target's metadata")
    x = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src),
                              [(remote_addr, SIZE // 2, 0)], name, b"written")
    agent.transfer(x)
    wait_done(agent, x)
    # The target checks its bytes when the notification arrives: delivered after data.
    tag, ok = to_parent.get(timeout=30)
    assert (tag, ok) == ("checked", True)
    agent.release_xfer_handle(x)
    from_parent.put("done")
    assert to_parent.get(timeout=30) == ("bye", True)
