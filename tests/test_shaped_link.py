"""benchmarks/shaped_link.sh: the ring across a tc-shaped link (root and tc only; skips saying
why elsewhere). The link must really be slow (a run that bypassed it through shared memory would
take a fraction of the time), and int8's quarter of the bytes must show in the time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "shaped_link.sh"

pytestmark = pytest.mark.mpi


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    if not (shutil.which("tc") and shutil.which("ip")):
        return "needs ip and tc (apt-get install iproute2)"
    probe = subprocess.run(["ip", "netns", "add", "mhprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "mhprobe"], capture_output=True)
    return None


def _milliseconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def test_ring_across_a_shaped_link() -> None:
    why = _why_not()
    if why:
        pytest.skip(why)
    env = dict(os.environ, RATE="200mbit", NS=f"mhtest{os.getpid()}", NP="2")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    args = ["allreduce", "--sizes", "1M", "--repeats", "2", "--codecs", "fp32,int8"]
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        cells = line.split()
        if len(cells) > 5 and cells[2] in ("mpi", "ring"):
            rows[(cells[2], cells[3])] = _milliseconds(" ".join(cells[4:6]))
    assert set(rows) == {("mpi", "fp32"), ("ring", "fp32"), ("ring", "int8")}, proc.stdout
    # 1 MiB each way through a shared 200 Mbit/s loopback: >= 84 ms at full rate; shared
    # memory takes well under 5 ms
    assert rows[("mpi", "fp32")] > 40, rows
    assert rows[("ring", "fp32")] > 40, rows
    assert rows[("ring", "int8")] < 0.6 * rows[("ring", "fp32")], rows
