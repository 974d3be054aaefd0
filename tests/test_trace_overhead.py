"""trace.events = false records one row per step; the overhead benchmark compares both modes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpihybrid.trace.file import load
from mpihybrid.trace.recorder import KIND
from tests.helpers import run_mpi

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

    def figure(label: str) -> float:
        return float(re.search(rf"{label}\s+([0-9.]+)", proc.stdout).group(1))

    traced, untraced = figure("step time traced"), figure("step time untraced")
    assert traced > 0 and untraced > 0, proc.stdout
    # the ratio printed is of the two step times printed (rounded to 0.001 ms)
    assert figure("traced / untraced") == pytest.approx(traced / untraced, rel=0.01)
