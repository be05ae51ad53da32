"""The batch API: many makes/posts/checks recorded, one flush, NumPy results."""
import numpy as np
import pytest

import ferry
from conftest import loopback_agent

BLOCK = 64
N = 1024


def setup():
    a, b = loopback_agent(), loopback_agent()
    src = (np.arange(N * BLOCK) % 251).astype(np.uint8)
    dst = np.zeros(N * BLOCK, dtype=np.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    rows = np.stack([np.arange(N, dtype=np.uint64) * BLOCK, np.full(N, BLOCK, dtype=np.uint64),
                     np.zeros(N, dtype=np.uint64)], axis=1)
    local = a.prep_xfer_dlist("", rows + np.array([src.ctypes.data, 0, 0], dtype=np.uint64))
    remote = a.prep_xfer_dlist(b.name, rows + np.array([dst.ctypes.data, 0, 0], dtype=np.uint64))
    return a, b, src, dst, local, remote


def test_make_many_post_check_in_one_flush():
    a, b, src, dst, local, remote = setup()
    batch = a.batch()
    # 256 requests of 4 blocks each, scattered: request i moves blocks 4i..4i+3 to
    # the mirrored slots.
    idx = np.arange(N, dtype=np.uint32).reshape(256, 4)
    made = batch.make_many("WRITE", local, idx, remote, (N - 1) - idx)
    assert made.dtype == np.uint32 and len(made) == 256
    assert (batch.statuses() == ferry.PENDING).all()
    a.flush(batch)
    st = batch.statuses()
    assert st.dtype == np.int8 and len(st) == 512
    assert (st[made] == ferry.OK).all()
    assert np.isin(st[made + 1], [ferry.OK, ferry.IN_PROGRESS]).all()
    handles = batch.handles()[made]
    assert handles.dtype == np.uint64 and (handles != 0).all()
    batch.raise_first()

    checks = a.batch()
    first = checks.check_many(handles)
    checks.drain_notifications()
    a.flush(checks)
    assert (checks.statuses()[first:first + 256] == ferry.OK).all()
    assert (dst.reshape(N, BLOCK)[::-1] == src.reshape(N, BLOCK)).all()

    # Repost all, check, release: three batches, one flush each.
    again = a.batch()
    again.post_many(handles)
    a.flush(again)
    assert not again.errors()
    rel = a.batch()
    rel.release_many(handles)
    a.flush(rel)
    assert (rel.statuses() == ferry.OK).all()
    assert a.counts()[0] == 0


def test_one_bad_command_fails_alone():
    a, b, src, dst, local, remote = setup()
    batch = ferry.Batch(16)
    good = batch.make("WRITE", local, [0], remote, [0], b"ok", post=True)
    bad = batch.make("WRITE", local, [N + 5], remote, [0], post=True)
    stale = batch.check(0xDEAD_0000_0001)
    a.flush(batch)
    st = batch.statuses()
    assert st[good] == ferry.OK and st[good + 1] in (ferry.OK, ferry.IN_PROGRESS)
    assert st[bad] == ferry.FAILED and st[bad + 1] == ferry.FAILED  # post depends on it
    assert st[stale] == ferry.FAILED
    errors = dict(batch.errors())
    assert set(errors) == {bad, bad + 1, stale}
    assert isinstance(errors[bad], ferry.InvalidParamError)
    assert isinstance(errors[stale], ferry.NotFoundError)
    assert batch.handles()[bad] == 0
    with pytest.raises(ferry.InvalidParamError):
        batch.raise_first()
    # A flushed batch is refused until cleared.
    failed, posted, _, _ = a.flush(batch)
    assert failed == len(batch) and posted == 0
    batch.clear()
    assert len(batch) == 0
    b_batch = b.batch()
    b_batch.drain_notifications()
    b.flush(b_batch)
    assert b_batch.notifications() == [(a.name, b"ok")]


def test_post_by_index_and_bad_shapes():
    a, b, src, dst, local, remote = setup()
    batch = a.batch()
    i = batch.make("READ", local, [1, 2], remote, [3, 4])
    batch.post(index=i)
    with pytest.raises(ferry.InvalidParamError):
        batch.post(index=99)
    with pytest.raises(ferry.InvalidParamError):
        batch.post()
    with pytest.raises(ferry.InvalidParamError):
        batch.make_many("READ", local, np.zeros((2, 2), np.uint32), remote, np.zeros((3, 2), np.uint32))
    with pytest.raises(ferry.InvalidParamError):
        batch.make_many("READ", local, np.zeros(4, np.uint32), remote, np.zeros(4, np.uint32))
    a.flush(batch)
    batch.raise_first()
    assert (dst[3 * BLOCK:5 * BLOCK] == 0).all()
    assert (src[BLOCK:3 * BLOCK] == 0).all()  # READ from zeros into src
