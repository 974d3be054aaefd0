"""train.schedule = "auto" under a cluster's bad day (issue 53): a preemption signal in the
calibration steps ends the job as a built-in schedule's would (exit 3, "preempted before step 1",
no false "no checkpoint.dir" line, no checkpoint of calibration weights), and the calibration
leaves nothing in the temporary directory; without OR-Tools auto says so in one line."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_mpi

pytestmark = pytest.mark.mpi

AUTO = ["--quiet", "--set", "model.hidden=16", "--set", "model.depth=4", "--set", "grid.pp=2",
        "--set", "train.schedule=auto", "--set", "train.schedule_calibrate=3",
        "--set", "train.steps=4"]  # fmt: skip


def _auto(tmp_path, script, *args):
    return run_mpi(2, *script, "train", *AUTO, *args, timeout=120,
                   env={"TMPDIR": str(tmp_path)})  # fmt: skip


@pytest.mark.parametrize("mode", ["usr1-calib", "term-calib"])
def test_preempted_in_calibration_exits_3_before_step_1(tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    proc = _auto(tmp_path, ("tests/_mpi_inject.py", mode), "--set", f"checkpoint.dir={ckpt}")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "preempted before step 1" in proc.stdout, proc.stdout
    assert "not set" not in proc.stdout + proc.stderr, proc.stderr  # no false "not set" line
    assert not list(ckpt.glob("step-*")), "a calibration's weights are no checkpoint of the job"
    assert not list(tmp_path.glob("mpihybrid-*")), list(tmp_path.iterdir())


def test_without_or_tools_auto_says_so_in_one_line(tmp_path):
    hidden = tmp_path / "hide" / "ortools"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    proc = run_mpi(2, "-m", "mpihybrid", "train", *AUTO, timeout=120,
                   env={"PYTHONPATH": f"{hidden.parent}:{ROOT}"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if "exact search is not installed" in x]
    assert len(lines) == 1 and "greedy" in lines[0] and "mpihybrid[search]" in lines[0], lines
