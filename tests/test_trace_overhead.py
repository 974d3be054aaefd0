"""trace.events = false records one row per step; the overhead benchmark compares both modes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpihybrid.trace.file import load
from mpihybrid.trace.recorder import KIND
from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def test_step_only_trace(tmp_path):
    path = tmp_path / "steps.h5"
    proc = run_mpi(2, "-m", "mpihybrid", "train", "--quiet", "--trace", str(path),
                   "--set", "train.steps=3", "--set", "trace.events=false")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    events = load(path).events
    assert len(events) == 3 * 2
    assert np.all(events["kind"] == KIND["step"])


def test_overhead_benchmark_prints_the_ratio():
    proc = run_mpi(2, "benchmarks/trace_overhead.py", "--repeats", "1",
                   "--set", "train.steps=4", "--set", "grid.dp=1", timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ratio = float(re.search(r"traced / untraced\s+([0-9.]+)", proc.stdout).group(1))
    assert ratio > 0
