#!/usr/bin/env python3
"""Run NIXL's own Python test suite and examples on Ferry, changed only in their imports.

NIXL's files are not part of this repository: they are read at run time from a NIXL
source tree (``--nixl-src DIR``, or ``--nixl-git URL`` to clone one; NIXL's PyPI release
ships wheels only, so no sdist carries them). Three ways to run them:

- ``--mode ferry`` (default): each ``import nixl...`` / ``from nixl... import`` line is
  rewritten to ``ferry.nixl...``; nothing else changes.
- ``--mode shim``: the files run unchanged, with ``engine/python/nixl-shim`` (the
  ``ferry-nixl`` package: ``nixl`` names on Ferry) first on ``PYTHONPATH``.
- ``--mode nixl``: unchanged, on NIXL itself (needs the ``nixl`` wheel), for comparison.

What runs: ``test/python/test_nixl_api.py`` (pytest; the pass/fail/skip counts are
printed), ``desc_perf.py``, ``prep_xfer_perf.py list|array``, and the examples
``query_mem_example.py``, ``partial_md_example.py``, ``basic_two_peers.py`` and
``expanded_two_peers.py`` (the last two as target + initiator processes). An example
passes when it exits 0 and prints its completion line(s). Exit status: 0 when all pass.

    python engine/python/tools/nixl_suite.py --nixl-src ~/src/nixl --mode ferry
"""
import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(os.path.dirname(HERE), "nixl-shim")

FILES = {
    "test/python/test_nixl_api.py": "test_nixl_api.py",
    "test/python/conftest.py": "conftest.py",
    "test/python/desc_perf.py": "desc_perf.py",
    "test/python/prep_xfer_perf.py": "prep_xfer_perf.py",
    "examples/python/query_mem_example.py": "query_mem_example.py",
    "examples/python/partial_md_example.py": "partial_md_example.py",
    "examples/python/basic_two_peers.py": "basic_two_peers.py",
    "examples/python/expanded_two_peers.py": "expanded_two_peers.py",
}

IMPORT = re.compile(r"^(\s*)(import|from)(\s+)nixl(?=[.\s])", re.MULTILINE)


def rewrite_imports(text):
    """``import nixl.x`` -> ``import ferry.nixl.x``; ``from nixl.x import`` likewise.
    Only lines that begin with import/from change."""
    return IMPORT.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3)}ferry.nixl", text)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, env, cwd, timeout_s):
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n[timed out after {timeout_s} s]"


def check(name, rc, out, needles, results):
    """PASS: exit 0 and every completion line printed. A script that printed them but
    then exited otherwise (NIXL 1.5.1's wheel segfaults at interpreter exit on some
    hosts) is reported as such, and fails."""
    missing = [n for n in needles if n not in out]
    ok = rc == 0 and not missing
    if missing:
        detail = f"rc={rc}, missing {missing}"
    elif rc != 0:
        detail = f"completion line printed, then rc={rc}"
    else:
        detail = "rc=0, completion line printed"
    results.append((name, ok, detail))
    if missing:
        print(f"--- {name} output (tail) ---\n{out[-4000:]}\n---")


def two_process(py, script, args, env, cwd, results, timeout_s):
    port = free_port()
    target = subprocess.Popen(
        [py, script, "--mode", "target", "--ip", "127.0.0.1", "--port", str(port)] + args,
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    rc_i, out_i = run([py, script, "--mode", "initiator", "--ip", "127.0.0.1", "--port", str(port)] + args,
                      env, cwd, timeout_s)
    try:
        out_t, _ = target.communicate(timeout=timeout_s)
        rc_t = target.returncode
    except subprocess.TimeoutExpired:
        target.kill()
        out_t, rc_t = target.communicate()[0] + "\n[timed out]", 124
    check(f"{script} (target)", rc_t, out_t, ["Test Complete."], results)
    needle = "Data verification passed" if script.startswith("basic") else "final data verification passed"
    check(f"{script} (initiator)", rc_i, out_i, [needle, "Test Complete."], results)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--nixl-src", help="a NIXL source tree")
    src.add_argument("--nixl-git", help="clone NIXL from this URL (e.g. https://github.com/ai-dynamo/nixl)")
    ap.add_argument("--ref", default=None, help="with --nixl-git: branch or tag to check out")
    ap.add_argument("--mode", choices=["ferry", "shim", "nixl"], default="ferry")
    ap.add_argument("--python", default=sys.executable, help="interpreter with ferry (and pytest, torch)")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per script")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()

    scratch = tempfile.mkdtemp(prefix="nixl-suite-")
    try:
        root = args.nixl_src
        if args.nixl_git:
            root = os.path.join(scratch, "nixl-src")
            cmd = ["git", "clone", "--depth", "1"] + (["--branch", args.ref] if args.ref else []) + [args.nixl_git, root]
            subprocess.run(cmd, check=True)
        work = os.path.join(scratch, "run")
        os.makedirs(work)
        for rel, name in FILES.items():
            with open(os.path.join(root, rel)) as f:
                text = f.read()
            if args.mode == "ferry":
                text = rewrite_imports(text)
            with open(os.path.join(work, name), "w") as f:
                f.write(text)

        env = dict(os.environ)
        env.setdefault("UCX_NET_DEVICES", "lo")
        if args.mode == "shim":
            env["PYTHONPATH"] = SHIM + os.pathsep + env.get("PYTHONPATH", "")
        py = args.python
        results = []

        rc, out = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "test_nixl_api.py"],
                      env, work, args.timeout * 3)
        summary = re.findall(r"^=*\s*(.*(?:passed|failed|error).*?)\s*=*$", out, re.MULTILINE)
        counts = summary[-1] if summary else "no summary"
        print(f"test_nixl_api.py ({args.mode}): {counts}")
        results.append(("test_nixl_api.py", rc == 0, counts))
        if rc != 0:
            print(out[-6000:])

        rc, out = run([py, "desc_perf.py"], env, work, args.timeout)
        check("desc_perf.py", rc, out, ["Time per desc add in us"], results)
        for mode in ("list", "array"):
            rc, out = run([py, "prep_xfer_perf.py", mode], env, work, args.timeout)
            check(f"prep_xfer_perf.py {mode}", rc, out, ["make_prepped_xfer:"], results)
        rc, out = run([py, "query_mem_example.py"], env, work, args.timeout)
        check("query_mem_example.py", rc, out, ["Example completed successfully!"], results)
        # partial_md_example deletes NIXL_ETCD_ENDPOINTS before its agents exist (it
        # must be set; its value is unused without --etcd): socket exchange.
        rc, out = run([py, "partial_md_example.py", "--init-port", str(free_port()),
                       "--target-port", str(free_port())],
                      dict(env, NIXL_ETCD_ENDPOINTS="unused"), work, args.timeout)
        check("partial_md_example.py", rc, out, ["Test Complete."], results)
        two_process(py, "basic_two_peers.py", [], env, work, results, args.timeout)
        two_process(py, "expanded_two_peers.py", [], env, work, results, args.timeout)

        print(f"\n{'script':40} {'result':6} detail  (mode {args.mode})")
        for name, ok, detail in results:
            print(f"{name:40} {'PASS' if ok else 'FAIL':6} {detail}")
        return 0 if all(ok for _, ok, _ in results) else 1
    finally:
        if args.keep:
            print(f"scratch kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
