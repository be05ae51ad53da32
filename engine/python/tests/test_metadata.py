"""Metadata through the exchange: P2P listeners and Ferry's own TCPStore server."""
import numpy as np
import pytest

import ferry
from conftest import loopback_agent, wait_done, wait_for


def move_and_verify(a, b, src, dst):
    local = a.prep_xfer_dlist("", a.get_xfer_descs(src))
    remote = a.prep_xfer_dlist(b.name, a.get_xfer_descs(dst))
    x = a.make_prepped_xfer("WRITE", local, [0], remote, [0], b"md-ok")
    a.transfer(x)
    wait_done(a, x)
    assert (dst == src).all()
    wait_for(lambda: b.check_remote_xfer_done(a.name, b"md-ok"), what="notification")


def test_p2p_fetch_push_and_invalidate():
    a = loopback_agent("p2p-a", enable_listen_thread=True)
    b = loopback_agent("p2p-b", enable_listen_thread=True)
    host, port = b.listen_addr
    assert host == "127.0.0.1" and port != 0
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    a.register_memory(src)
    b.register_memory(dst)

    assert not a.check_remote_metadata(b.name)
    a.fetch_remote_metadata(b.name, host, port)
    wait_for(lambda: a.check_remote_metadata(b.name), what="P2P fetch")
    assert a.check_remote_metadata(b.name, a.get_xfer_descs(dst))
    move_and_verify(a, b, src, dst)

    # Push ours to b, then withdraw it: b forgets us.
    a.send_local_metadata(host, port)
    wait_for(lambda: b.check_remote_metadata(a.name), what="P2P push")
    a.invalidate_local_metadata(host, port)
    wait_for(lambda: not b.check_remote_metadata(a.name), what="P2P invalidation")


def test_p2p_partial_metadata_accumulates():
    a = loopback_agent("part-a", enable_listen_thread=True)
    b = loopback_agent("part-b", enable_listen_thread=True)
    host, port = b.listen_addr
    one = np.zeros(64, dtype=np.uint8)
    two = np.zeros(64, dtype=np.uint8)
    r1 = b.register_memory(one)
    b.register_memory(two)
    # Partial metadata (only `one`) through the side channel, then the full set by P2P.
    blob = b.get_partial_agent_metadata(r1, inc_conn_info=True)
    assert a.add_remote_agent(blob) == b.name
    assert a.check_remote_metadata(b.name, a.get_xfer_descs(one))
    assert not a.check_remote_metadata(b.name, a.get_xfer_descs(two))
    a.fetch_remote_metadata(b.name, host, port)
    wait_for(lambda: a.check_remote_metadata(b.name, a.get_xfer_descs(two)), what="full fetch")


def test_p2p_fetch_failure_raises():
    a = loopback_agent("fail-a", enable_listen_thread=True)
    # Nobody named so behind a's own listener address... a closed port instead:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    a.fetch_remote_metadata("nobody-here", "127.0.0.1", port)

    def failed():
        try:
            a.check_remote_metadata("nobody-here")
            return False
        except ferry.FerryError:
            return True
    wait_for(failed, what="fetch failure")


def test_tcpstore_publish_fetch_and_withdraw():
    server = loopback_agent("store-a", serve_store="127.0.0.1:0")
    endpoint = server.store_addr
    assert endpoint and endpoint.startswith("127.0.0.1:")
    client = loopback_agent("store-b", store=endpoint)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    server.register_memory(dst)
    client.register_memory(src)

    server.send_local_metadata()  # publish in the store, by name
    client.fetch_remote_metadata(server.name)
    wait_for(lambda: client.check_remote_metadata(server.name), what="TCPStore fetch")
    move_and_verify(client, server, src, dst)

    server.invalidate_local_metadata()
    wait_for(lambda: not client.check_remote_metadata(server.name), timeout_s=20,
             what="TCPStore withdrawal")


def test_name_based_call_without_store_raises():
    a = loopback_agent()
    with pytest.raises(ferry.FerryError):
        a.send_local_metadata()
    with pytest.raises(ferry.InvalidParamError):
        a.fetch_remote_metadata("x", "no such host!", 1)
