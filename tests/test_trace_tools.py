"""The trace commands on what a new user has: a trace.events = false trace (what it holds, what
it cannot show, no traceback), compare's column labels, steps counted from 1, unfinished runs."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from mpihybrid.cli import main
from mpihybrid.cli.trace import short_labels
from mpihybrid.trace.file import write_trace
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND

ATTRS = {"world_size": 2, "pp": 2, "dp": 1, "schedule": "1f1b", "microbatches": 4,
         "virtual_stages": 1, "codec": "fp32", "hostnames": ["a", "a"]}  # fmt: skip
CONFIG = "[train]\nglobal_batch = 32\nsteps = 3\n"


def step_rows(steps: int = 3, ranks: int = 2) -> np.ndarray:
    rows = np.zeros(steps * ranks, EVENT_DTYPE)
    rows["kind"] = KIND["step"]
    rows["rank"] = np.tile(np.arange(ranks), steps)
    rows["step"] = np.repeat(np.arange(steps), ranks)
    rows["start"] = rows["step"] * 0.010
    rows["end"] = rows["start"] + 0.008
    return rows


@pytest.fixture
def steps_only(tmp_path):
    path = tmp_path / "steps.h5"
    metrics = {"step": np.arange(3), "loss": [2.0, 1.5, 1.2], "accuracy": [0.1, 0.2, 0.3]}
    write_trace(path, events=step_rows(), steps=metrics, config=CONFIG, attrs=ATTRS)
    return path


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_analyze_says_what_a_steps_only_trace_cannot_show(steps_only):
    result = cli("analyze", steps_only)
    assert result.exit_code == 0, result.output
    assert "trace.events = false" in result.output and "no time split, bubble" in result.output
    assert "bubble measured" not in result.output  # no zeros printed as if measured
    assert "mean 8.00 ms" in result.output and "final loss 1.2000" in result.output


def test_timeline_draws_a_steps_only_trace_and_ascii_refuses_in_one_line(steps_only, tmp_path):
    out = tmp_path / "steps.png"
    result = cli("timeline", steps_only, "-o", out, "--steps", "1:3")
    assert result.exit_code == 0, result.output  # was: ValueError traceback from matplotlib
    assert out.read_bytes()[:4] == b"\x89PNG" and "steps 1-2" in result.output
    result = cli("timeline", steps_only, "--ascii")
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "trace.events = false" in lines[0]


def test_analyze_says_a_run_did_not_finish(tmp_path):
    path = tmp_path / "stopped.h5"
    write_trace(path, events=step_rows(), steps={}, config=CONFIG, attrs=ATTRS)
    import h5py

    with h5py.File(path, "a") as f:
        f.attrs["finished"], f.attrs["stopped_at_step"] = False, 3
    assert "stopped after step 3" in cli("analyze", path).output


def test_compare_labels_by_the_shortest_distinguishing_path(tmp_path):
    assert short_labels(["runs/a/trace.h5", "runs/b/trace.h5"]) == ["a/trace.h5", "b/trace.h5"]
    assert short_labels(["x/1f1b.h5", "x/zb.h5"]) == ["1f1b.h5", "zb.h5"]
    assert short_labels(["p/q/t.h5", "r/q/t.h5"]) == ["p/q/t.h5", "r/q/t.h5"]
