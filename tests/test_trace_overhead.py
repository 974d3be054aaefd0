"""trace.events = false records one row per step; the overhead benchmark compares the modes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpihybrid.trace.read import load
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


def test_overhead_benchmark_prints_the_ratios():
    proc = run_mpi(2, "benchmarks/trace_overhead.py", "--repeats", "1", "--flush-steps", "2",
                   "--set", "train.steps=5", "--set", "grid.dp=1", timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = re.findall(r"^(.+?)\s+([0-9.]+) ms/step\s+x([0-9.]+)$", proc.stdout, re.M)
    modes = {label.strip(): (float(ms), float(ratio)) for label, ms, ratio in found}
    assert list(modes) == ["events", "step rows only", "file, flushed every 2"], proc.stdout
    base = modes["events"][0]
    for ms, ratio in modes.values():
        assert ms > 0
        # the ratio printed is of the step times printed (rounded to 0.001 ms)
        assert ratio == pytest.approx(ms / base, rel=0.01, abs=1e-3)
    assert "ms per flush" in proc.stdout
