"""benchmarks/two_nodes.sh: two nodes on one machine (root, ip, tc and unshare only; skips saying
why elsewhere). MPI must report the two nodes, a message inside a node must stay off the link,
and one between them must cross it at the shaped rate."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import flavour

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "two_nodes.sh"

pytestmark = pytest.mark.mpi


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    if flavour() != "MPICH":  # the harness launches with Hydra and MPICH's OFI netmod
        return f"the harness is MPICH's (Hydra, OFI over TCP); the tests run {flavour()}"
    missing = [tool for tool in ("ip", "tc", "unshare") if not shutil.which(tool)]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    probe = subprocess.run(["ip", "netns", "add", "mh2nprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "mh2nprobe"], capture_output=True)
    return None


def test_two_nodes_are_two_nodes() -> None:
    why = _why_not()
    if why:
        pytest.skip(why)
    env = dict(os.environ, RATE="200mbit", TWO_NODES=f"mh{os.getpid() % 10000}", SUBNET="10.78.0")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = ["bash", str(SCRIPT), "run", "A:2,B:2", sys.executable,
           "benchmarks/two_nodes_probe.py", "--mib", "2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["nodes"] == [[0, 1], [2, 3]], result
    assert result["hosts"][0] != result["hosts"][2], result
    same, cross = result["same_node"], result["cross_node"]
    # 2 MiB each way at 200 Mbit/s: >= 84 ms, so under 0.2 Gbit/s; shared memory is far faster
    assert cross["gbit_s"] < 0.3 and same["gbit_s"] > 1.0, result
    assert cross["link_bytes"] >= 3 * 2 * 2**20, result  # three exchanges went over the link
    assert 0 <= same["link_bytes"] < 64 * 1024, result  # and none inside the node


def _leftovers(prefix: str) -> list[str]:
    names = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [w for w in (names + spaces).replace(":", " ").replace("@", " ").split()
             if w.startswith(prefix)]  # fmt: skip
    etc = Path("/etc/netns")
    return sorted(set(found)) + sorted(str(p) for p in etc.glob(f"{prefix}*") if etc.is_dir())


def test_a_sigterm_with_a_short_grace_leaves_nothing_and_up_clears_leftovers() -> None:
    """`timeout -k 5`'s way: SIGTERM to the script while its ranks run, SIGKILL 5 s later. The
    bridge, the links, the namespaces and /etc/netns entries go within the grace; a run killed
    outright leaves them, and the next `up` removes them first."""
    import signal
    import time

    why = _why_not()
    if why:
        pytest.skip(why)
    prefix = f"mt{os.getpid() % 10000}"
    env = dict(os.environ, TWO_NODES=prefix, SUBNET="10.79.0")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"

    def start():
        argv = ["bash", str(SCRIPT), "run", "A:1,B:1", "sleep", "60"]
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        for _ in range(200):  # the nodes up and the ranks started
            if f"{prefix}B" in _leftovers(prefix) and "sleep 60" in subprocess.run(
                ["ps", "-eo", "args"], capture_output=True, text=True).stdout:  # fmt: skip
                return proc
            time.sleep(0.1)
        raise AssertionError("the two nodes did not come up")

    try:
        proc = start()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert _leftovers(prefix) == [], "left after SIGTERM and a 5 s grace"
        proc = start()
        proc.kill()  # no grace at all: the next `up` finds what it left
        proc.wait()
        assert _leftovers(prefix)
        up = subprocess.run(["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True)
        assert up.returncode == 0, up.stderr
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True)
    assert _leftovers(prefix) == []
