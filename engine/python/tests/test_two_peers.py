"""NIXL's two-peer flow on ferry.nixl, between two processes, over the P2P listener.

The shape of NIXL's ``basic_two_peers.py``: a target listening on a port registers a
torch tensor, waits for the initiator's metadata, and sends it the pickled transfer
list of the tensor's rows as a notification; the initiator fetches the target's
metadata from that port and pushes its own, reads the rows with ``initialize_xfer``
(a str notification), checks the data, and invalidates its metadata at the target.
"""
import multiprocessing as mp
import os
import socket
import time
import traceback

import pytest

from conftest import need_ucx


def need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        reason = "torch is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}, and CI=true")
        pytest.skip(reason)


def _target(conn, port):
    try:
        import torch

        from ferry.nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("target", nixl_agent_config(True, True, port))
        tensor = torch.arange(10 * 16, dtype=torch.float32).reshape(10, 16)
        reg = agent.register_memory(tensor)
        rows = agent.get_xfer_descs([tensor[i, :] for i in range(10)])
        conn.send("listening")
        deadline = time.monotonic() + 30
        while not agent.check_remote_metadata("initiator"):
            assert time.monotonic() < deadline, "no metadata from the initiator"
        agent.send_notif("initiator", agent.get_serialized_descs(rows))
        while True:
            notifs = agent.get_new_notifs()
            if b"Done_reading" in notifs.get("initiator", []):
                break
            assert time.monotonic() < deadline, "no Done_reading"
        while agent.check_remote_metadata("initiator"):
            assert time.monotonic() < deadline, "the initiator's invalidation did not arrive"
        agent.deregister_memory(reg)
        conn.send("ok")
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _initiator(conn, port):
    try:
        import torch

        from ferry.nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("initiator", nixl_agent_config(True, True, 0))
        tensor = torch.zeros((10, 16), dtype=torch.float32)
        reg = agent.register_memory(tensor)
        agent.fetch_remote_metadata("target", "127.0.0.1", port)
        agent.send_local_metadata("127.0.0.1", port)
        deadline = time.monotonic() + 30
        notifs = agent.get_new_notifs()
        while not notifs:
            assert time.monotonic() < deadline, "no descriptor list from the target"
            notifs = agent.get_new_notifs()
        remote = agent.deserialize_descs(notifs["target"][0])
        local = agent.get_xfer_descs([tensor[i, :] for i in range(10)])
        while not agent.check_remote_metadata("target"):
            assert time.monotonic() < deadline, "no metadata from the target"
        h = agent.initialize_xfer("READ", local, remote, "target", "Done_reading")
        assert agent.transfer(h) in ("DONE", "PROC")
        while agent.check_xfer_state(h) != "DONE":
            assert time.monotonic() < deadline, "the read did not finish"
        assert torch.equal(tensor, torch.arange(160, dtype=torch.float32).reshape(10, 16))
        agent.remove_remote_agent("target")
        agent.release_xfer_handle(h)
        agent.invalidate_local_metadata("127.0.0.1", port)
        agent.deregister_memory(reg)
        conn.send("ok")
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _answer(conn, what):
    assert conn.poll(90), f"no answer while waiting for {what}"
    got = conn.recv()
    if isinstance(got, tuple) and got[0] == "error":
        raise AssertionError(f"{what} failed:\n{got[1]}")
    return got


def test_basic_two_peers_flow_between_two_processes():
    need_ucx()
    need_torch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    target = ctx.Process(target=_target, args=(t_child, port), daemon=True)
    target.start()
    initiator = None
    try:
        assert _answer(t_parent, "target start") == "listening"
        initiator = ctx.Process(target=_initiator, args=(i_child, port), daemon=True)
        initiator.start()
        assert _answer(i_parent, "initiator") == "ok"
        assert _answer(t_parent, "target") == "ok"
    finally:
        for p in (target, initiator):
            if p is not None:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    assert target.exitcode == 0 and initiator.exitcode == 0
