"""The NIXL-style flow on the built-in LOOPBACK backend (one process)."""
import numpy as np
import pytest

import ferry
from conftest import unique, loopback_agent, wait_done


def test_nixl_flow_write_and_read_with_notification():
    a, b = loopback_agent("init"), loopback_agent("target")
    src = np.arange(64 * 1024, dtype=np.uint8)
    dst = np.zeros(64 * 1024, dtype=np.uint8)
    a_reg = a.register_memory(src)
    b_reg = b.register_memory(dst)
    assert len(a_reg) == 1 and a_reg.is_registered and a_reg.mem_type == "DRAM"

    assert a.add_remote_agent(b.get_agent_metadata()) == b.name
    assert b.add_remote_agent(a.get_agent_metadata()) == a.name

    # 16 blocks of 4 KiB on each side, prepared once.
    block = 4096
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT",
                              [(src.ctypes.data + i * block, block, 0) for i in range(16)], "DRAM")
    remote = a.prep_xfer_dlist(b.name,
                               [(dst.ctypes.data + i * block, block, 0) for i in range(16)], "DRAM")
    # Write blocks 0..7 to remote slots 8..15 in reverse.
    x = a.make_prepped_xfer("WRITE", local, list(range(8)), remote,
                            np.arange(15, 7, -1, dtype=np.int64), b"blocks-0-7")
    assert isinstance(x, ferry.XferHandle)
    assert a.transfer(x) in ("DONE", "PROC")
    wait_done(a, x)
    for i in range(8):
        assert (dst[(15 - i) * block:(16 - i) * block] == src[i * block:(i + 1) * block]).all()
    assert (dst[:8 * block] == 0).all()
    assert b.check_remote_xfer_done(a.name, b"blocks-")

    tel = a.get_xfer_telemetry(x)
    assert tel["totalBytes"] == 8 * block and tel["descCountUnmerged"] == 8

    # Reuse the request (repost), then read back with a fresh request.
    assert a.transfer(x) in ("DONE", "PROC")
    wait_done(a, x)
    a.release_xfer_handle(x)
    back = np.zeros_like(src)
    back_reg = a.register_memory(back)
    lback = a.prep_xfer_dlist("", a.get_xfer_descs(back))
    rall = a.prep_xfer_dlist(b.name, b.get_xfer_descs(dst))
    a.add_remote_agent(b.get_agent_metadata())  # idempotent reload
    y = a.make_prepped_xfer("READ", lback, [0], rall, [0])
    a.transfer(y)
    wait_done(a, y)
    assert (back == dst).all()
    a.release_xfer_handle(y)
    for h in (local, remote, lback, rall):
        a.release_dlist_handle(h)
    a.deregister_memory(back_reg)
    a.deregister_memory(a_reg)
    b.deregister_memory(b_reg)
    assert a.registered_count() == 0 and not a_reg.is_registered


def test_initialize_xfer_and_merging():
    a, b = loopback_agent(), loopback_agent()
    src = np.full(8192, 7, dtype=np.uint8)
    dst = np.zeros(8192, dtype=np.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    # Two adjacent halves on both sides merge into one range.
    halves_src = a.get_xfer_descs([(src.ctypes.data, 4096, 0), (src.ctypes.data + 4096, 4096, 0)])
    halves_dst = a.get_xfer_descs([(dst.ctypes.data, 4096, 0), (dst.ctypes.data + 4096, 4096, 0)])
    x = a.initialize_xfer("WRITE", halves_src, halves_dst, b.name, b"one-shot")
    a.transfer(x)
    wait_done(a, x)
    assert (dst == 7).all()
    assert a.get_xfer_telemetry(x)["descCount"] == 1
    assert b.get_new_notifs() == {a.name: [b"one-shot"]}
    assert b.get_new_notifs() == {}


def test_notifications_standalone_and_to_self():
    a, b = loopback_agent(), loopback_agent()
    b.register_memory(np.zeros(16, dtype=np.uint8))
    a.add_remote_agent(b.get_agent_metadata())
    a.send_notif(b.name, b"hello")
    a.send_notif(b.name, b"")
    a.send_notif(a.name, b"me")
    assert b.get_new_notifs() == {a.name: [b"hello", b""]}
    assert a.get_new_notifs() == {a.name: [b"me"]}
    a.send_notif(b.name, b"tag-123")
    assert not b.check_remote_xfer_done(a.name, b"tag-124", tag_is_prefix=False)
    assert b.check_remote_xfer_done(a.name, b"tag-123", tag_is_prefix=False)
    assert not b.check_remote_xfer_done(a.name, b"tag")


def test_descriptor_sources():
    a = loopback_agent()
    arr = np.zeros((4, 256), dtype=np.float32)
    ba = bytearray(1024)
    mv = memoryview(bytearray(512))
    reg = a.register_memory([arr, ba, mv])
    assert len(reg) == 3
    d = reg.descs()
    assert d[0] == (arr.ctypes.data, arr.nbytes, 0)
    assert d[1][1] == 1024 and d[2][1] == 512
    # A held export: the bytearray cannot be resized while registered.
    with pytest.raises(BufferError):
        ba.extend(b"x")
    a.deregister_memory(reg)
    del reg
    import gc
    gc.collect()
    ba.extend(b"x")  # released with the registration
    rows = np.array([[arr.ctypes.data, 64, 0], [arr.ctypes.data + 64, 64, 0]], dtype=np.uint64)
    xd = a.get_xfer_descs(rows)
    assert xd.descs() == [(arr.ctypes.data, 64, 0), (arr.ctypes.data + 64, 64, 0)]


def test_plugins_and_backends():
    a = ferry.Agent(f"plug-{id(object())}", ferry.AgentConfig(backends=[]))
    plugins = a.get_plugin_list()
    assert "LOOPBACK" in plugins and "POSIX" in plugins
    assert "DRAM" in a.get_plugin_mem_types("LOOPBACK")
    assert isinstance(a.get_plugin_params("POSIX"), dict)
    assert a.create_backend("loopback") == "LOOPBACK"
    assert a.get_backends() == ["LOOPBACK"]
    assert isinstance(a.get_backend_params("LOOPBACK"), dict)
    with pytest.raises(ferry.NotAllowedError):
        a.create_backend("LOOPBACK")
    with pytest.raises(ferry.NotFoundError):
        a.create_backend("NOPE")
    with pytest.raises(ferry.InvalidParamError):
        a.create_backend("POSIX", {"no_such_param": "1"})


def test_nixl_names_are_the_nixl_layer():
    import ferry.nixl._api as api

    assert ferry.nixl_agent is api.nixl_agent
    assert ferry.nixl_agent_config is api.nixl_agent_config
    agent = ferry.nixl_agent(unique("alias"), ferry.nixl_agent_config(backends=["LOOPBACK"]))
    assert isinstance(agent.agent.ferry, ferry.Agent)
    assert agent.agent.ferry.get_backends() == ["LOOPBACK"]


def test_array_sizes_come_from_numpy():
    a = loopback_agent()
    text = np.zeros(16, dtype="<U3")  # 12 bytes per item, typestr says 3
    assert a.get_reg_descs(text).descs()[0][1] == text.nbytes == 192
    rec = np.zeros(4, dtype=[("a", "<u4"), ("b", "<f8")])
    assert a.get_reg_descs(rec).descs()[0][1] == rec.nbytes
