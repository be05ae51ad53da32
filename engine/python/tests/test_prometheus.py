"""The wheel's `prometheus` feature: FERRY_METRICS_LISTEN serves the agents' metrics.

Runs in a child process (the endpoint starts with the process's first agent)."""
import os
import socket
import subprocess
import sys

import ferry


def test_metrics_endpoint_serves_the_agents_figures():
    assert ferry.PROMETHEUS, "the module was built without the prometheus feature"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"""
import time, urllib.request
import ferry
a = ferry.Agent("prom-a", ferry.AgentConfig(backends=["LOOPBACK"]))
b = ferry.Agent("prom-b", ferry.AgentConfig(backends=["LOOPBACK"]))
src, dst = bytearray(b"x" * 4096), bytearray(4096)
a.register_memory(src); b.register_memory(dst)
a.add_remote_agent(b.get_agent_metadata())
x = a.initialize_xfer("WRITE", a.get_xfer_descs(src), a.get_xfer_descs(dst), b.name)
a.transfer(x)
while a.check_xfer_state(x) != "DONE":
    pass
assert a.metrics()["backends"]["LOOPBACK"]["bytes"] == 4096
for _ in range(100):
    try:
        body = urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        break
    except OSError:
        time.sleep(0.05)
print(body)
"""
    env = dict(os.environ, FERRY_METRICS_LISTEN=f"127.0.0.1:{port}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [l for l in out.stdout.splitlines() if l.startswith("ferry_bytes_posted_total")]
    assert any('agent="prom-a"' in l and l.rstrip().endswith(" 4096") for l in lines), lines
