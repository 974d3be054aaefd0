"""Every count and size a bench command takes is bounded: a typo is one line and exit 2, not a
day-long run or a MemoryError traceback on every rank."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import mpi_env


def mpihybrid(*args):
    return subprocess.run([sys.executable, "-m", "mpihybrid", *args], capture_output=True,
                          text=True, env=mpi_env(), timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "allreduce", "--sizes", "inf"], "--sizes 'inf'"),
        (["bench", "allreduce", "--sizes", ",".join(["4K"] * 65)], "65 sizes; at most 64"),
        (["bench", "allreduce", "--repeats", "100000000"], "--repeats"),
        (["bench", "train", "--steps", "10000000"], "--steps"),
        (["bench", "train", "--repeats", "10000000"], "--repeats"),
    ],
)
def test_bench_counts_and_sizes_are_bounded(args, message):
    proc = mpihybrid(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
