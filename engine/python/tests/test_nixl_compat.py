"""ferry.nixl: NIXL 1.5.1's Python API on Ferry, behaviour by behaviour.

Each test states one behaviour NIXL's own test suite or examples rely on (argument
forms, return values, which exception), checked on Ferry. Tests that move data need
UCX (they fail under CI=true when it is missing); the tensor tests need torch (same
rule).
"""
import os
import pickle
import tempfile

import numpy as np
import pytest

import ferry
import ferry.nixl._bindings as nb
import ferry.nixl._utils as nu
from ferry.nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
from conftest import need_ucx, unique


def need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        reason = "torch is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}, and CI=true")
        pytest.skip(reason)
    return torch


def empty_agent():
    return nixl_agent(unique("nx-empty"), nixl_agent_config(backends=[]))


def ucx_agent(prefix="nx", **conf):
    need_ucx()
    return nixl_agent(unique(prefix), nixl_agent_config(backends=["UCX"], **conf))


def wait_state(agent, handle, limit=20000):
    for _ in range(limit):
        state = agent.check_xfer_state(handle)
        assert state in ("DONE", "PROC")
        if state == "DONE":
            return
    raise AssertionError("transfer did not finish")


def wait_notif(agent, sender, tag, limit=200000):
    for _ in range(limit):
        if agent.check_remote_xfer_done(sender, tag):
            return
    raise AssertionError(f"no notification {tag!r} from {sender}")


# ---------------------------------------------------------------- construction


def test_an_empty_name_raises_value_error():
    with pytest.raises(ValueError):
        nixl_agent("")


def test_sync_mode_must_be_the_enum():
    with pytest.raises(TypeError, match="sync_mode must be a nixl_thread_sync_t"):
        nixl_agent_config(sync_mode=1)


@pytest.mark.parametrize("listen", [False, True])
@pytest.mark.parametrize("mode", [None] + list(nixl_thread_sync_t))
def test_sync_mode_reaches_the_bindings_config(monkeypatch, mode, listen):
    seen = {}
    real = nb.nixlAgent

    def spy(name, config):
        seen["mode"] = config.syncMode
        return real(name, config)

    monkeypatch.setattr(nb, "nixlAgent", spy)
    nixl_agent(unique("nx-sync"), nixl_agent_config(sync_mode=mode, enable_listen_thread=listen,
                                                    listen_port=0, backends=[]))
    if mode is not None:
        want = mode.value
    else:
        want = (nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if listen
                else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE).value
    assert seen["mode"] == want
    # DEFAULT is NONE's alias, as in NIXL: three members.
    assert len(list(nixl_thread_sync_t)) == 3


def test_two_live_agents_may_share_a_name():
    name = unique("nx-twin")
    a = nixl_agent(name, nixl_agent_config(backends=[]))
    b = nixl_agent(name, nixl_agent_config(backends=[]))
    assert a.name == b.name == name
    # Ferry's own Agent still refuses by default.
    with pytest.raises(ferry.NotAllowedError):
        ferry.Agent(name, ferry.AgentConfig(backends=[]))
        ferry.Agent(name, ferry.AgentConfig(backends=[]))


def test_unknown_plugins_give_empty_answers_and_creating_one_raises_not_found():
    a = empty_agent()
    assert a.get_plugin_mem_types("UVX") == [] and a.get_plugin_params("UVX") == {}
    assert a.get_backend_mem_types("UVX") == [] and a.get_backend_params("UVX") == {}
    with pytest.raises(nb.nixlNotFoundError):
        a.create_backend("UVX")
    assert nb.nixlNotFoundError is ferry.NotFoundError


def test_create_backend_records_params_and_mem_types():
    a = empty_agent()
    a.create_backend("LOOPBACK")
    assert "DRAM" in a.get_backend_mem_types("LOOPBACK")
    assert isinstance(a.get_backend_params("LOOPBACK"), dict)
    assert "LOOPBACK" in a.backends


def test_unknown_operation_raises_key_error_before_anything_else():
    a = empty_agent()
    with pytest.raises(KeyError):
        a.make_prepped_xfer("RD", 0, [], 0, [])
    lists = nb.nixlXferDList(nb.DRAM_SEG), nb.nixlXferDList(nb.DRAM_SEG)
    with pytest.raises(KeyError):
        a.initialize_xfer("WR", lists[0], lists[1], "nobody")


def test_unknown_backend_name_in_hints_raises_key_error():
    a = empty_agent()
    with pytest.raises(KeyError):
        a.register_memory([(1, 2, 0, "")], "DRAM", backends=["NOPE"])


# ---------------------------------------------------------------- descriptor lists


def test_get_xfer_descs_returns_none_for_what_it_cannot_build():
    a = empty_agent()
    assert a.get_xfer_descs([(1, 2, 3, 4)]) is None                # no mem_type
    assert a.get_xfer_descs([(1, 2, 3, 4)], "DRAM") is None        # 4-tuples
    assert a.get_xfer_descs([(1, 2, 3)], mem_type=None) is None
    assert a.get_xfer_descs(nb.nixlRegDList(nb.DRAM_SEG)) is None  # a reg list
    assert a.get_xfer_descs(np.zeros((2, 4), dtype=np.uint64), "DRAM") is None
    with pytest.raises(KeyError):
        a.get_xfer_descs([(1, 2, 3)], mem_type="V-RAM")
    x = nb.nixlXferDList(nb.DRAM_SEG)
    assert a.get_xfer_descs(x) is x


def test_get_reg_descs_returns_none_for_what_it_cannot_build():
    a = empty_agent()
    assert a.get_reg_descs([(1, 2, 3)]) is None
    assert a.get_reg_descs([(1, 2, 3)], "DRAM") is None            # 3-tuples
    assert a.get_reg_descs([(1, 2, 3, 4)], mem_type=None) is None
    assert a.get_reg_descs(nb.nixlXferDList(nb.DRAM_SEG)) is None
    with pytest.raises(KeyError):
        a.get_reg_descs([(1, 2, 3, 4)], mem_type="V-RAM")


def test_list_forms_counts_items_trim_and_pickle():
    a = empty_agent()
    reg = a.get_reg_descs([(10, 20, 0, "meta"), (30, 40, 1, b"raw")], "DRAM")
    assert reg.descCount() == 2 and not reg.isEmpty() and reg.getType() == nb.DRAM_SEG
    assert reg[0] == (10, 20, 0, b"meta") and reg[1] == (30, 40, 1, b"raw")
    x = reg.trim()
    assert isinstance(x, nb.nixlXferDList) and x[1] == (30, 40, 1) and x.descCount() == 2
    rows = np.array([[1, 2, 0], [3, 4, 0], [5, 6, 0]], dtype=np.uint64)
    arr = a.get_xfer_descs(rows, "VRAM")
    assert arr.descCount() == 3 and arr.getType() == nb.VRAM_SEG and arr[2] == (5, 6, 0)
    assert a.get_reg_descs(rows, "DRAM")[0] == (1, 2, 0, b"")
    back = a.deserialize_descs(a.get_serialized_descs(arr))
    assert back == arr and back is not arr
    arr.addDesc((7, 8, 0))
    assert arr.descCount() == 4 and arr.index((7, 8, 0)) == 3
    arr.remDesc(0)
    assert arr[0] == (3, 4, 0)
    arr.clear()
    assert arr.isEmpty()
    assert bool(nb.nixlXferDList(nb.DRAM_SEG))  # a list object is truthy, empty or not
    remote = a.get_remote_descs([(1, 2, 0, "peer")], "DRAM")
    assert remote[0] == (1, 2, 0, "peer")
    assert a.get_remote_descs([(1, 2, 0)], "DRAM") is None


def test_many_descriptors_from_tuples():
    a = empty_agent()
    n = 100_000
    x = a.get_xfer_descs([(4096, 256, 0)] * n, "DRAM")
    assert x.descCount() == n


def test_tensors_give_lists_and_non_contiguous_ones_give_none():
    torch = need_torch()
    a = empty_agent()
    t = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    assert a.get_reg_descs(t.t()) is None and a.get_xfer_descs(t.t()) is None
    reg = a.get_reg_descs(t)
    assert reg[0] == (t.data_ptr(), 32, 0, b"") and reg.getType() == nb.DRAM_SEG
    rows = a.get_xfer_descs([t[0], t[1]])
    assert rows.descCount() == 2 and rows[1] == (t[1].data_ptr(), 16, 0)
    # A pickled list carries no tensors.
    assert b"torch" not in pickle.dumps(reg)


# ---------------------------------------------------------------- transfers


def test_register_returns_the_list_and_metadata_names_the_peer_in_bytes():
    a, b = ucx_agent("nx-md-a"), ucx_agent("nx-md-b")
    addr = nu.malloc_passthru(1024)
    try:
        reg = a.get_reg_descs([(addr, 1024, 0, "anything")], "DRAM")
        assert a.register_memory(reg) is reg
        assert b.add_remote_agent(a.get_agent_metadata()) == a.name.encode()
        a.deregister_memory(reg)
        with pytest.raises(nb.nixlNotFoundError):
            a.deregister_memory(reg)
    finally:
        nu.free_passthru(addr)


def test_a_write_with_str_and_bytes_notifications_and_a_new_one_at_transfer():
    a, b = ucx_agent("nx-w-a"), ucx_agent("nx-w-b")
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    ra = a.register_memory([(src.ctypes.data, 4096, 0, "")], "DRAM")
    rb = b.register_memory([(dst.ctypes.data, 4096, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data + i * 1024, 1024, 0) for i in range(4)], "DRAM")
    remote = a.prep_xfer_dlist(b.name, [(dst.ctypes.data + i * 1024, 1024, 0) for i in range(4)], "DRAM")
    h = a.make_prepped_xfer("WRITE", local, [0, 1], remote, np.array([3, 2]), "first")
    assert a.transfer(h) in ("DONE", "PROC")
    wait_state(a, h)
    wait_notif(b, a.name, b"first")
    assert (dst[3072:] == src[:1024]).all() and (dst[2048:3072] == src[1024:2048]).all()
    # A notification given at transfer() replaces the one the request was made with.
    dst[:] = 0
    assert a.transfer(h, b"second") in ("DONE", "PROC")
    wait_state(a, h)
    wait_notif(b, a.name, b"second")
    assert (dst[3072:] == src[:1024]).all()
    # check_remote_xfer_done: prefix by default, containment with tag_is_prefix=False,
    # and an empty tag matches anything.
    a.send_notif(b.name, "tag-123")
    a.send_notif(b.name, b"xx-needle-yy")
    a.send_notif(b.name, b"whatever")
    wait_notif(b, a.name, "tag-")
    for _ in range(200000):
        if b.check_remote_xfer_done(a.name, b"needle", tag_is_prefix=False):
            break
    else:
        raise AssertionError("containment match failed")
    wait_notif(b, a.name, b"")
    assert not b.check_remote_xfer_done(a.name, b"")
    a.release_xfer_handle(h)
    h.release()  # a second release does nothing
    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)
    a.remove_remote_agent(b.name)
    a.deregister_memory(ra)
    b.deregister_memory(rb)


def test_initialize_xfer_read_get_new_notifs_and_not_posted():
    a, b = ucx_agent("nx-r-a"), ucx_agent("nx-r-b")
    mine = np.zeros(2048, dtype=np.uint8)
    theirs = np.full(2048, 7, dtype=np.uint8)
    a.register_memory([(mine.ctypes.data, 2048, 0, "")], "DRAM")
    b.register_memory([(theirs.ctypes.data, 2048, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    local = a.get_xfer_descs([(mine.ctypes.data, 2048, 0)], "DRAM")
    remote = a.get_xfer_descs([(theirs.ctypes.data, 2048, 0)], "DRAM")
    h = a.initialize_xfer("READ", local, remote, b.name, b"read-done")
    with pytest.raises(nb.nixlNotPostedError):
        a.check_xfer_state(h)
    a.transfer(h)
    wait_state(a, h)
    assert (mine == 7).all()
    got = {}
    for _ in range(200000):
        for k, v in b.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        if got:
            break
    assert got == {a.name: [b"read-done"]}
    a.release_xfer_handle(h)


def test_loopback_to_our_own_name_with_numpy_indices():
    a = ucx_agent("nx-self")
    buf = np.arange(8192, dtype=np.uint8)
    out = np.zeros(8192, dtype=np.uint8)
    a.register_memory(np.array([[buf.ctypes.data, 8192, 0], [out.ctypes.data, 8192, 0]], dtype=np.uint64), "DRAM")
    src = a.prep_xfer_dlist("", [(buf.ctypes.data, 8192, 0)], "DRAM")
    dst = a.prep_xfer_dlist(a.name, [(out.ctypes.data, 8192, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", src, np.arange(1), dst, np.arange(1), b"self")
    assert h
    a.transfer(h)
    wait_state(a, h)
    assert (out == buf).all()
    a.release_xfer_handle(h)


def _telemetry_run(a, b):
    n = 128
    x, y = nu.malloc_passthru(n), nu.malloc_passthru(n)
    try:
        a.register_memory([(x, n, 0, "")], "DRAM")
        b.register_memory([(y, n, 0, "")], "DRAM")
        a.add_remote_agent(b.get_agent_metadata())
        src = a.get_xfer_descs([(x, n // 2, 0), (x + n // 2, n // 2, 0)], "DRAM")
        dst = a.get_xfer_descs([(y, n // 2, 0), (y + n // 2, n // 2, 0)], "DRAM")
        h = a.initialize_xfer("WRITE", src, dst, b.name, b"t")
        a.transfer(h)
        wait_state(a, h)
        wait_notif(b, a.name, b"t")
        return h
    finally:
        pass


def test_telemetry_is_an_object_in_nixl_units(monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    a, b = ucx_agent("nx-tel-a"), ucx_agent("nx-tel-b")
    h = _telemetry_run(a, b)
    t = a.get_xfer_telemetry(h)
    assert isinstance(t, nb.nixlXferTelemetry)
    assert (t.descCount, t.totalBytes) == (2, 128)
    assert t.startTime > 1_600_000_000_000_000  # µs since the epoch
    assert t.postDuration > 0 and t.xferDuration >= t.postDuration
    a.release_xfer_handle(h)


def test_telemetry_off_raises_no_telemetry_and_the_environment_wins(monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "no")
    a = ucx_agent("nx-notel-a", capture_telemetry=True)
    b = ucx_agent("nx-notel-b")
    h = _telemetry_run(a, b)
    with pytest.raises(nb.nixlNoTelemetryError):
        a.get_xfer_telemetry(h)
    a.release_xfer_handle(h)
    monkeypatch.delenv("NIXL_TELEMETRY_ENABLE")
    c = ucx_agent("nx-cfgtel", capture_telemetry=True)
    assert c.agent.telemetry and not ucx_agent("nx-cfgoff").agent.telemetry


def test_metrics_and_estimate_after_a_transfer(monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    a, b = ucx_agent("nx-met-a"), ucx_agent("nx-met-b")
    h = _telemetry_run(a, b)
    m = a.metrics()
    assert m["backends"]["UCX"]["completed"] >= 1 and m["backends"]["UCX"]["bytes"] >= 128
    duration, margin, method = a.estimate_xfer_cost(h)
    assert method in ("ANALYTICAL_BACKEND", "MEASURED") and duration >= 0 and margin >= 0
    assert ferry.PROMETHEUS in (True, False)


def test_partial_metadata_covers_only_the_lists_sent():
    a, b = ucx_agent("nx-pm-t"), ucx_agent("nx-pm-i")
    one = [nu.malloc_passthru(256) for _ in range(4)]
    two = [nu.malloc_passthru(256) for _ in range(4)]
    mine = [nu.malloc_passthru(256) for _ in range(4)]
    try:
        r1 = a.get_reg_descs([(p, 256, 0, "x") for p in one], "DRAM")
        r2 = a.get_reg_descs([(p, 256, 0, "x") for p in two], "DRAM")
        a.register_memory(r1)
        a.register_memory(r2)
        ri = b.register_memory([(p, 256, 0, "") for p in mine], "DRAM")
        b.add_remote_agent(a.get_partial_agent_metadata(r1, True))
        assert b.check_remote_metadata(a.name, r1.trim())
        # The list's memory type counts: the same rows as VRAM are not what a registered.
        assert not b.check_remote_metadata(a.name, nb.nixlXferDList(nb.VRAM_SEG, r1.trim()._rows))
        h1 = b.initialize_xfer("READ", ri.trim(), r1.trim(), a.name, b"p1")
        b.transfer(h1)
        wait_state(b, h1)
        with pytest.raises(nb.nixlNotFoundError):
            b.initialize_xfer("READ", ri.trim(), r2.trim(), a.name)
        b.add_remote_agent(a.get_partial_agent_metadata(r2, True))
        h2 = b.initialize_xfer("READ", ri.trim(), r2.trim(), a.name)
        b.transfer(h2)
        wait_state(b, h2)
        b.release_xfer_handle(h1)
        b.release_xfer_handle(h2)
        # Connection info alone: an empty list.
        assert a.get_partial_agent_metadata(nb.nixlRegDList(nb.DRAM_SEG), True)
    finally:
        for p in one + two + mine:
            nu.free_passthru(p)


def test_query_memory_of_files():
    a = nixl_agent(unique("nx-q"), nixl_agent_config(enable_prog_thread=False, backends=[]))
    a.create_backend("POSIX", a.get_plugin_params("POSIX"))
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"twelve bytes")
        f.flush()
        got = a.query_memory([(0, 0, 0, f.name), (0, 0, 0, f.name + ".missing")], "POSIX", mem_type="FILE")
        assert got[1] is None
        assert got[0]["size"] == "12" and int(got[0]["mode"]) & 0o100000
        assert abs(int(got[0]["mtime"]) - int(os.stat(f.name).st_mtime)) <= 1
    with pytest.raises(ValueError):
        a.query_memory([(0, 0, 0, "/x")], "UCX", mem_type="FILE")


def test_utils_fill_and_compare():
    p, q = nu.malloc_passthru(64), nu.malloc_passthru(64)
    nu.ba_buf(p, 64)
    nu.ba_buf(q, 64)
    nu.verify_transfer(p, q, 64)
    import ctypes
    ctypes.memset(q, 0, 1)
    with pytest.raises(AssertionError):
        nu.verify_transfer(p, q, 64)
    nu.free_passthru(p)
    nu.free_passthru(q)


def test_the_shim_gives_the_nixl_names_as_the_same_modules():
    import subprocess
    import sys

    shim = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nixl-shim")
    code = (
        "import nixl, nixl._api, nixl._bindings as b, nixl._utils, nixl.logging\n"
        "from nixl._api import nixl_agent, nixl_agent_config\n"
        "from nixl import nixl_agent as top\n"
        "import ferry.nixl._bindings as fb, ferry.nixl._api as fa\n"
        "assert nixl.__ferry__ and b is fb and nixl._api is fa and top is fa.nixl_agent\n"
        "assert b.nixlNotFoundError is __import__('ferry').NotFoundError\n"
        "from nixl._api import nixlBind\n"
        "from nixl._bindings import nixlXferTelemetry\n"
        "assert nixlBind is b\n"
        "print('shim-ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=shim + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "shim-ok" in out.stdout, out.stderr


def _listening(prefix):
    a = ucx_agent(prefix, enable_listen_thread=True, listen_port=0)
    host, port = a.agent.ferry.listen_addr
    return a, port


def _until(predicate, what, limit_s=20.0):
    import time

    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.002)


def test_listener_exchange_partial_push_fetch_and_invalidate():
    # partial_md_example's and basic_two_peers' metadata flows, over the P2P listener.
    target, target_port = _listening("nx-p2p-t")
    init, init_port = _listening("nx-p2p-i")
    bufs = [np.full(256, i, dtype=np.uint8) for i in range(2)]
    r1 = target.register_memory([(bufs[0].ctypes.data, 256, 0, "")], "DRAM")
    r2 = target.register_memory([(bufs[1].ctypes.data, 256, 0, "")], "DRAM")
    mine = np.zeros(256, dtype=np.uint8)
    ri = init.register_memory([(mine.ctypes.data, 256, 0, "")], "DRAM")
    # Partial push of the first list only (backend names as hints, as the example does).
    target.send_partial_agent_metadata(r1, True, ["UCX"], "127.0.0.1", init_port)
    _until(lambda: init.check_remote_metadata(target.name, r1.trim()), "partial push")
    assert not init.check_remote_metadata(target.name, r2.trim())
    h = init.initialize_xfer("READ", ri.trim(), r1.trim(), target.name, b"p2p")
    assert init.transfer(h) in ("DONE", "PROC")
    wait_state(init, h)
    assert (mine == 0).all()
    _until(lambda: target.check_remote_xfer_done(init.name, b"p2p"), "notification")
    init.release_xfer_handle(h)
    # Full metadata both ways: the initiator fetches, and pushes its own.
    init.fetch_remote_metadata(target.name, "127.0.0.1", target_port)
    init.send_local_metadata("127.0.0.1", target_port)
    _until(lambda: init.check_remote_metadata(target.name, r2.trim()), "fetch")
    _until(lambda: target.check_remote_metadata(init.name), "push")
    # A pickled descriptor list sent as a notification, read back as a list.
    target.send_notif(init.name, target.get_serialized_descs(r2.trim()))
    got = {}
    _until(lambda: got.update(init.get_new_notifs()) or target.name in got, "descs")
    descs = init.deserialize_descs(got[target.name][0])
    h2 = init.initialize_xfer("READ", ri.trim(), descs, target.name, "str-notif")
    init.transfer(h2)
    wait_state(init, h2)
    assert (mine == 1).all()
    _until(lambda: target.check_remote_xfer_done(init.name, "str-notif"), "str notification")
    init.release_xfer_handle(h2)
    init.invalidate_local_metadata("127.0.0.1", target_port)
    _until(lambda: not target.check_remote_metadata(init.name), "invalidation")
    init.remove_remote_agent(target.name)
