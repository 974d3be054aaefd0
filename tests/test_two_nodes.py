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
