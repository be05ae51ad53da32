"""Shared helpers of the ferry Python tests.

Tests that need UCX fail under CI=true when it is missing and skip (saying why)
elsewhere, as the Rust tests do.
"""
import itertools
import os
import time

import pytest

import ferry

_names = itertools.count()


def unique(prefix):
    """An agent name no other live agent of this process has."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def loopback_agent(prefix="lb", **config):
    return ferry.Agent(unique(prefix), ferry.AgentConfig(backends=["LOOPBACK"], **config))


def need_ucx():
    """Skip (or fail under CI=true) when the UCX backend cannot run here."""
    if "UCX" in ferry.Agent(unique("probe"), ferry.AgentConfig(backends=[])).get_plugin_list():
        return
    reason = "UCX backend unavailable (libucp.so.0 missing)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}, and CI=true")
    pytest.skip(reason)


def wait_done(agent, handle, timeout_s=10.0):
    """Poll check_xfer_state until DONE (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        assert state == "PROC", state
        if time.monotonic() > deadline:
            raise AssertionError(f"transfer still {state} after {timeout_s} s")


def wait_for(predicate, timeout_s=10.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def pair():
    """Two loopback agents, each knowing the other's metadata once memory is in."""
    return loopback_agent("a"), loopback_agent("b")
