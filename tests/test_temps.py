"""Nothing left in the temporary directory (issue 53), per exit path: an untraced run that stops
on a NaN or an interrupt leaves no flight records; one that fails names where its record went;
an aborted auto calibration's directory is removed by the next run (temps.sweep)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import tempfile

import pytest

from mpihybrid import temps
from tests.helpers import run_mpi

TINY = ["--quiet", "--set", "model.hidden=16", "--set", "model.depth=4", "--set", "train.steps=5"]


def _inject(tmp_path, mode, *args):
    return run_mpi(2, "tests/_mpi_inject.py", mode, "train", *TINY, *args, timeout=120,
                   env={"TMPDIR": str(tmp_path)})  # fmt: skip


def _left(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("mpihybrid-*"))


@pytest.mark.mpi
@pytest.mark.parametrize("mode, code", [("nan-grad", 1), ("int-one", 130)])
def test_an_untraced_agreed_stop_leaves_nothing(tmp_path, mode, code):
    proc = _inject(tmp_path, mode)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert _left(tmp_path) == [], proc.stderr


@pytest.mark.mpi
def test_an_untraced_failure_says_where_its_record_is(tmp_path):
    proc = _inject(tmp_path, "exit-one")
    assert proc.returncode != 0
    said = re.findall(r"\(flight record: (\S+)\)", proc.stderr)
    assert said, proc.stderr
    for path in said:
        assert os.path.isfile(path) and path.startswith(str(tmp_path)), path
    named = {os.path.basename(os.path.dirname(p)) for p in said}
    assert set(_left(tmp_path)) <= named, (_left(tmp_path), proc.stderr)


@pytest.mark.mpi
def test_an_aborted_calibration_is_swept_by_the_next_run(tmp_path, monkeypatch):
    proc = _inject(tmp_path, "exit-one", "--set", "grid.pp=2", "--set", "train.schedule=auto",
                   "--set", "train.schedule_calibrate=3")  # fmt: skip
    assert proc.returncode != 0
    assert "(flight record: " not in proc.stderr  # none points into the removed calibration
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    temps.sweep("mpihybrid-auto-")  # what the next auto run does first
    assert [n for n in _left(tmp_path) if n.startswith("mpihybrid-auto-")] == []


def test_sweep_removes_only_a_dead_makers_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    gone = tmp_path / f"mpihybrid-auto-{dead.pid}@{host}.abc123"
    mine = tmp_path / f"mpihybrid-auto-{os.getpid()}@{host}.def456"
    other = tmp_path / f"mpihybrid-auto-{dead.pid}@not-{host}.ghi789"
    for d in (gone, mine, other):
        (d / "x").mkdir(parents=True)
    made = temps.make_dir("mpihybrid-auto-")
    assert not gone.exists() and mine.exists() and other.exists() and made.is_dir()
    temps.remove_all()
    assert not made.exists()
