"""Bad input raises a typed exception carrying Ferry's status name; nothing crashes."""
import numpy as np
import pytest

import ferry
from conftest import loopback_agent, unique, wait_done


def test_hierarchy_and_status_names():
    for cls, status in [(ferry.InvalidParamError, "INVALID_PARAM"), (ferry.NotFoundError, "NOT_FOUND"),
                        (ferry.MismatchError, "MISMATCH"), (ferry.NotAllowedError, "NOT_ALLOWED"),
                        (ferry.RepostActiveError, "REPOST_ACTIVE"), (ferry.NotSupportedError, "NOT_SUPPORTED"),
                        (ferry.BackendError, "BACKEND"), (ferry.RemoteDisconnectError, "REMOTE_DISCONNECT"),
                        (ferry.CanceledError, "CANCELED"), (ferry.NoTelemetryError, "NO_TELEM"),
                        (ferry.PoisonedError, "POISONED")]:
        assert issubclass(cls, ferry.FerryError) and issubclass(cls, Exception)
        assert cls.status == status


def test_bad_arguments():
    a = loopback_agent()
    with pytest.raises(ferry.InvalidParamError, match="memory type"):
        a.get_xfer_descs([(1, 2, 0)], "PINK")
    with pytest.raises(ferry.InvalidParamError, match="cannot describe"):
        a.get_xfer_descs(object())
    with pytest.raises(ferry.InvalidParamError, match="empty"):
        a.get_xfer_descs([])
    with pytest.raises(ferry.InvalidParamError, match="integer"):
        a.get_xfer_descs([(-1, 2, 0)])
    with pytest.raises(ferry.InvalidParamError, match="not C-contiguous"):
        a.register_memory(np.zeros((8, 8), dtype=np.uint8)[:, ::2])
    ro = np.zeros(64, dtype=np.uint8)
    ro.setflags(write=False)
    with pytest.raises(ferry.InvalidParamError, match="read-only"):
        a.register_memory(ro)
    with pytest.raises(ferry.InvalidParamError, match="writable"):
        a.register_memory(b"immutable bytes")
    with pytest.raises(ferry.MismatchError):
        a.register_memory(np.zeros(8, dtype=np.uint8), "VRAM")
    with pytest.raises(ferry.NotSupportedError):
        a.register_memory([(0x1000, 64, 0)], "VRAM")
    with pytest.raises(ferry.InvalidParamError, match="READ"):
        a.make_prepped_xfer("COPY", 1, [0], 2, [0])
    with pytest.raises(ferry.InvalidParamError, match="metadata"):
        a.add_remote_agent(b"not metadata")
    with pytest.raises(ferry.NotFoundError):
        a.prep_xfer_dlist("nobody", [(0x1000, 8, 0)])
    with pytest.raises(ferry.NotAllowedError):
        ferry.Agent(a.name, ferry.AgentConfig(backends=["LOOPBACK"]))
    with pytest.raises(ferry.InvalidParamError):
        ferry.Agent("", ferry.AgentConfig(backends=["LOOPBACK"]))
    with pytest.raises(ferry.NotFoundError):
        a.register_memory(np.zeros(8, dtype=np.uint8), backends=["GDS"])


def test_handles_are_typed_and_checked():
    a, b = loopback_agent(), loopback_agent()
    src = np.ones(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("", a.get_xfer_descs(src))
    remote = a.prep_xfer_dlist(b.name, a.get_xfer_descs(dst))
    x = a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    with pytest.raises(ferry.InvalidParamError, match="prepared-list handle"):
        a.transfer(local)
    with pytest.raises(ferry.InvalidParamError, match="transfer handle"):
        a.make_prepped_xfer("WRITE", x, [0], remote, [0])
    with pytest.raises(ferry.InvalidParamError):
        a.make_prepped_xfer("WRITE", local, [5], remote, [0])  # index out of the list
    with pytest.raises(ferry.InvalidParamError):
        a.make_prepped_xfer("WRITE", local, [-1], remote, [0])
    with pytest.raises(ferry.NotFoundError):
        a.transfer(0xDEAD_0000_0001)  # never a handle
    a.transfer(x)
    wait_done(a, x)
    a.release_xfer_handle(x)
    with pytest.raises(ferry.NotFoundError):
        a.check_xfer_state(x)  # stale: released
    with pytest.raises(ferry.NotFoundError):
        a.release_xfer_handle(x)
    with pytest.raises(ferry.NotSupportedError):
        a.transfer(a.make_prepped_xfer("WRITE", local, [0], remote, [0]), b"late notif")


def test_unregistered_memory_is_refused():
    a, b = loopback_agent(), loopback_agent()
    b.register_memory(np.zeros(64, dtype=np.uint8))
    a.add_remote_agent(b.get_agent_metadata())
    stray = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ferry.NotFoundError) as info:
        a.prep_xfer_dlist("", a.get_xfer_descs(stray))
    assert info.value.status == "NOT_FOUND"
    assert info.value.kind == "NotFound"


def test_removed_peer_fails_requests():
    a, b = loopback_agent(), loopback_agent()
    src = np.ones(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("", a.get_xfer_descs(src))
    remote = a.prep_xfer_dlist(b.name, a.get_xfer_descs(dst))
    x = a.make_prepped_xfer("WRITE", local, [], remote, [])
    a.remove_remote_agent(b.name)
    with pytest.raises(ferry.NotFoundError):
        a.transfer(x)
    with pytest.raises(ferry.NotFoundError):
        a.remove_remote_agent(b.name)
    with pytest.raises(ferry.NotFoundError):
        a.send_notif(unique("ghost"), b"x")


def test_serialized_descs_round_trip_and_garbage():
    a = loopback_agent()
    rows = [(0x1000, 64, 0), (0x2000, 128, 1)]
    blob = a.get_serialized_descs(a.get_xfer_descs(rows, "DRAM"))
    back = a.deserialize_descs(blob)
    assert back.descs() == rows and back.mem_type == "DRAM"
    with pytest.raises(ferry.InvalidParamError):
        a.deserialize_descs(b"\x00" * 7)
    with pytest.raises(ferry.InvalidParamError):
        a.deserialize_descs(blob[:-3])
