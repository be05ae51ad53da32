"""A real libcufile loaded without a GPU: the state PyTorch's CUDA wheel makes (it
brings the nvidia-cufile wheel's libcufile.so.0 and loads it at `import torch`). Some
cuFile builds spin forever inside cuFileDriverOpen there; Ferry's probes must not call
it, so creating an agent returns at once.

Each case runs in a child Python killed past a bound, so a hang fails instead of hanging
the run. Under CI=true a missing torch or FERRY_TEST_CUFILE fails; elsewhere they skip
saying why.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

# The longest a child may take (imports included); creation itself must be far quicker.
CHILD_LIMIT_S = 60.0
CREATE_LIMIT_S = 0.1

CHILD = textwrap.dedent(
    """
    import ctypes, json, os, sys, time
    mode, lib = sys.argv[1], sys.argv[2]
    if mode == "torch":
        import torch  # loads its libcufile.so.0
        loaded = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcufile.so" in l})
    else:
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        loaded = [lib]
    import ferry
    out = {"loaded": loaded}
    t = time.monotonic()
    plugins = ferry.Agent("probe-%d" % os.getpid(), ferry.AgentConfig(backends=[])).get_plugin_list()
    out["probe_s"] = time.monotonic() - t
    out["plugins"] = plugins
    # What nixl_agent(name) does by default, when UCX works here.
    if "UCX" in plugins:
        t = time.monotonic()
        ferry.nixl_agent("default-%d" % os.getpid())
        out["nixl_agent_s"] = time.monotonic() - t
    # Every available backend but UCX (whose context costs what UCX costs), as
    # instantiate_all does.
    t = time.monotonic()
    ferry.Agent("all-%d" % os.getpid(),
                ferry.AgentConfig(backends=[p for p in plugins if p != "UCX"]))
    out["create_s"] = time.monotonic() - t
    # GDS by name over the loaded library: refused with a reason, at once.
    a = ferry.Agent("gds-%d" % os.getpid(), ferry.AgentConfig(backends=[]))
    t = time.monotonic()
    try:
        a.create_backend("GDS", {"cufile_library": loaded[0]} if loaded else {})
        out["gds"] = "created"
    except ferry.FerryError as e:
        out["gds"] = "%s: %s" % (type(e).__name__, e)
    out["gds_s"] = time.monotonic() - t
    print("RESULT " + json.dumps(out))
    """
)


def _missing(what, why):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is required under CI=true: {why}")
    pytest.skip(f"{what}: {why}")


def _libraries():
    value = os.environ.get("FERRY_TEST_CUFILE", "")
    if not value:
        _missing("a real libcufile", "FERRY_TEST_CUFILE is not set (tools/test.sh sets it)")
    libs = value.split(":")
    for lib in libs:
        if not os.path.isfile(lib):
            _missing("a real libcufile", f"FERRY_TEST_CUFILE names {lib}, which does not exist")
    return libs


def _no_nvidia_device():
    return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg"))


def _run(mode, lib, tmp_path):
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, mode, lib],
            capture_output=True, text=True, timeout=CHILD_LIMIT_S,
            cwd=tmp_path,  # cuFile writes cufile.log into the working directory
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"agent creation with {mode} {lib} did not finish within "
                    f"{CHILD_LIMIT_S} s (it blocks or spins): {e.stdout!r} {e.stderr!r}")
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    print(mode, lib, out)
    assert out["probe_s"] < 1.0, out
    assert out["create_s"] < CREATE_LIMIT_S, out
    assert out["gds_s"] < CREATE_LIMIT_S, out
    if _no_nvidia_device():
        assert "GDS" not in out["plugins"], out
        assert out["gds"].startswith("NotSupportedError"), out
        assert "no NVIDIA device" in out["gds"], out
        assert not (tmp_path / "cufile.log").exists(), "cuFile was called"
    return out


def test_agent_creation_after_import_torch_returns_at_once(tmp_path):
    try:
        import torch  # noqa: F401  (importable before and beside ferry)
    except ImportError as e:
        _missing("torch (its CUDA wheel brings libcufile)", e)
    import ferry  # noqa: F401
    out = _run("torch", "", tmp_path)
    # The state under test: torch really loaded a libcufile into the process.
    assert out["loaded"], f"import torch loaded no libcufile.so: {out}"


def test_agent_creation_with_a_real_cufile_loaded_returns_at_once(tmp_path):
    for i, lib in enumerate(_libraries()):
        scratch = tmp_path / str(i)
        scratch.mkdir()
        _run("lib", lib, scratch)
