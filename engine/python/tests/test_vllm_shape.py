"""vLLM's NixlConnector call sequence on ferry.nixl, between two processes.

A "prefill" process holds a KV cache (torch tensors, one per layer, split in blocks);
a "decode" process pulls some of its blocks, the way vLLM's connector does:

- both: ``nixl_agent(uuid, nixl_agent_config(backends=["UCX"]))``, ``import torch``
  before the first agent; register the KV tensors through ``get_reg_descs`` of
  ``(addr, len, device, "")`` tuples; describe every block with ``get_xfer_descs`` and
  ``prep_xfer_dlist("NIXL_INIT_AGENT", ...)``;
- a side channel (a pipe here, ZMQ in vLLM) carries ``get_agent_metadata()`` and the
  block table from prefill to decode;
- decode: ``add_remote_agent`` (its return value, bytes, is used as the remote name from
  then on), ``prep_xfer_dlist(remote_name, ...)``, ``make_prepped_xfer("READ", ...,
  notif_msg=b"req-id:tp")``, ``transfer``, ``check_xfer_state`` until DONE,
  ``release_xfer_handle``, ``send_notif(remote_name, notif_msg=...)``;
- prefill: ``get_new_notifs()`` until both notifications arrived;
- teardown: ``release_dlist_handle``, ``remove_remote_agent``, ``deregister_memory``.

CPU tensors always; CUDA tensors where torch sees a GPU (and the extension has CUDA).
"""
import multiprocessing as mp
import os
import time
import traceback
import uuid

import pytest

from conftest import need_ucx

LAYERS = 3
BLOCKS = 16
BLOCK_ELEMS = 512  # float16 -> 1 KiB per block per layer
PULL = [1, 4, 5, 6, 11, 15]   # prefill's blocks the request needs
INTO = [0, 2, 3, 7, 8, 9]     # decode's free blocks they go to
REQ = b"cmpl-0000-1234:1"


def need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        reason = "torch is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}, and CI=true")
        pytest.skip(reason)


def _kv(torch, device, fill):
    caches = []
    for layer in range(LAYERS):
        t = torch.zeros((BLOCKS, BLOCK_ELEMS), dtype=torch.float16, device=device)
        if fill:
            for b in range(BLOCKS):
                t[b] = float(layer * 100 + b)
        caches.append(t)
    return caches


def _register(agent, caches, mem):
    dev = lambda t: max(t.get_device(), 0)  # noqa: E731
    regions = [(t.data_ptr(), t.numel() * t.element_size(), dev(t), "") for t in caches]
    descs = agent.get_reg_descs(regions, mem)
    agent.register_memory(descs)
    block_len = caches[0][0].numel() * caches[0].element_size()
    blocks = [
        (t.data_ptr() + b * block_len, block_len, dev(t)) for t in caches for b in range(BLOCKS)
    ]
    return descs, blocks, block_len


def _ids(layer_blocks):
    return [layer * BLOCKS + b for layer in range(LAYERS) for b in layer_blocks]


def _prefill(conn, device):
    try:
        import torch  # before the first agent, as vLLM's workers do

        from ferry.nixl._api import nixl_agent, nixl_agent_config

        mem = "DRAM" if device == "cpu" else "VRAM"
        agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"]))
        caches = _kv(torch, device, fill=True)
        reg, blocks, _ = _register(agent, caches, mem)
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks, mem))
        conn.send((agent.get_agent_metadata(), blocks, agent.name))
        want = {REQ, b"free:" + REQ}
        got = set()
        deadline = time.monotonic() + 60
        while got != want:
            for _sender, msgs in agent.get_new_notifs().items():
                got.update(msgs)
            assert time.monotonic() < deadline, f"prefill: notifications so far {got}"
        conn.send(("notified", sorted(got)))
        assert conn.recv() == "bye"
        agent.release_dlist_handle(local)
        agent.deregister_memory(reg)
        conn.send("ok")
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _decode(conn, device):
    try:
        import torch

        from ferry.nixl._api import nixl_agent, nixl_agent_config

        mem = "DRAM" if device == "cpu" else "VRAM"
        agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"]))
        caches = _kv(torch, device, fill=False)
        reg, blocks, _ = _register(agent, caches, mem)
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks, mem))
        metadata, remote_blocks, prefill_name = conn.recv()
        remote_name = agent.add_remote_agent(metadata)
        assert remote_name == prefill_name.encode()
        remote = agent.prep_xfer_dlist(remote_name, agent.get_xfer_descs(remote_blocks, mem))
        handle = agent.make_prepped_xfer(
            "READ", local, _ids(INTO), remote, _ids(PULL), notif_msg=REQ
        )
        agent.transfer(handle)
        deadline = time.monotonic() + 60
        while True:
            state = agent.check_xfer_state(handle)
            if state == "DONE":
                break
            assert state == "PROC", state
            assert time.monotonic() < deadline, "decode: read did not finish"
        agent.release_xfer_handle(handle)
        agent.send_notif(remote_name, notif_msg=b"free:" + REQ)
        for layer in range(LAYERS):
            for src, dst in zip(PULL, INTO):
                assert (caches[layer][dst] == float(layer * 100 + src)).all(), (layer, src, dst)
            untouched = [b for b in range(BLOCKS) if b not in INTO]
            assert (caches[layer][untouched] == 0).all(), layer
        conn.send("read-ok")
        assert conn.recv() == "done"
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote)
        agent.remove_remote_agent(remote_name)
        agent.deregister_memory(reg)
        conn.send("ok")
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _expect(conn, what, timeout_s=90):
    assert conn.poll(timeout_s), f"no answer while waiting for {what!r}"
    got = conn.recv()
    if isinstance(got, tuple) and got and got[0] == "error":
        raise AssertionError(f"child failed:\n{got[1]}")
    return got


def _devices():
    return ["cpu", "cuda"]


@pytest.mark.parametrize("device", _devices())
def test_vllm_connector_sequence_between_two_processes(device):
    need_ucx()
    need_torch()
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device here (the CPU case runs everywhere)")
    ctx = mp.get_context("spawn")
    p_parent, p_child = ctx.Pipe()
    d_parent, d_child = ctx.Pipe()
    prefill = ctx.Process(target=_prefill, args=(p_child, device), daemon=True)
    decode = ctx.Process(target=_decode, args=(d_child, device), daemon=True)
    prefill.start()
    decode.start()
    try:
        metadata = _expect(p_parent, "prefill metadata")
        d_parent.send(metadata)
        assert _expect(d_parent, "decode read") == "read-ok"
        notified = _expect(p_parent, "prefill notifications")
        assert notified == ("notified", sorted([REQ, b"free:" + REQ]))
        d_parent.send("done")
        assert _expect(d_parent, "decode teardown") == "ok"
        p_parent.send("bye")
        assert _expect(p_parent, "prefill teardown") == "ok"
    finally:
        for proc in (prefill, decode):
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert prefill.exitcode == 0 and decode.exitcode == 0
