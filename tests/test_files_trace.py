"""A trace flush costs its own rows: later flushes write parts beside the file (merged at the
end), never a copy of the whole file; a full disk stops the trace, not the training."""

from __future__ import annotations

import errno
import logging
import subprocess

import numpy as np
import pytest

from mpihybrid.trace import file as trace_file
from mpihybrid.trace.file import TraceWriter
from mpihybrid.trace.read import load, parts_dir
from tests.helpers import run_mpi
from tests.test_trace_stream import metrics, rows


def writer_of(path) -> TraceWriter:
    writer = TraceWriter(path, config="", attrs={"pp": 1, "hostnames": ["a"]})
    writer.start()
    writer.flush(rows([]), {})
    return writer


def test_flushes_append_parts_and_the_finished_trace_is_one_file(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_file, "_EVENT_CHUNK", 1024)  # the least a merge appends
    path = tmp_path / "run.h5"
    writer = writer_of(path)
    writer.flush(rows(range(0, 200)), metrics(range(0, 200)))  # a part of 600 rows
    assert len(list(parts_dir(path).iterdir())) == 1
    writer.flush(rows(range(200, 400)), metrics(range(200, 400)))  # a part, 600 rows
    writer.flush(rows([]), {})  # 1200 rows in parts >= max(file, a chunk): merged
    assert not parts_dir(path).exists()
    published = path.stat()
    for step in range(400, 410):
        writer.flush(rows([step], t0=3 * step), metrics([step]))
        assert path.stat().st_ino == published.st_ino  # the file is not written again
        trace = load(path)  # a reader sees every flush so far
        assert len(trace.events) == 3 * (step + 1) and trace.attrs["finished"] is False
        np.testing.assert_array_equal(trace.steps["step"], np.arange(step + 1))
    assert len(list(parts_dir(path).iterdir())) == 10
    writer.flush(rows([410], t0=1230), metrics([410]), attrs={"runtime_s": 2.0}, finished=True)
    assert [p.name for p in tmp_path.iterdir()] == ["run.h5"]
    final = load(path)
    assert len(final.events) == 3 * 411 and final.attrs["finished"] is True
    assert final.attrs["runtime_s"] == 2.0 and len(final.attrs["file_id"]) == 16
    np.testing.assert_array_equal(final.events["start"][-33:], np.arange(1200, 1233.0))


def test_parts_are_merged_before_they_outnumber_max_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_file, "MAX_PARTS", 4)
    path = tmp_path / "run.h5"
    writer = writer_of(path)
    writer.flush(rows(range(0, 400)), metrics(range(0, 400)))
    for step in range(400, 420):
        writer.flush(rows([step]), metrics([step]))
        assert len(list(parts_dir(path).glob("*.h5"))) <= 4
    assert len(load(path).events) == 3 * 420


def test_parts_of_an_earlier_file_are_ignored_and_removed(tmp_path):
    """A crash after the merged file's rename, before its parts were removed: the new file has
    another file_id, so the old parts are never read twice; the next publish removes them."""
    path = tmp_path / "run.h5"
    writer = writer_of(path)
    writer.flush(rows(range(0, 400)), metrics(range(0, 400)))
    writer.flush(rows([400]), metrics([400]))
    stale = parts_dir(path) / "0123456789abcdef-000001.h5"
    stale.write_bytes((parts_dir(path) / f"{writer._file_id}-000001.h5").read_bytes())
    assert len(load(path).events) == 3 * 401
    writer.flush(rows([401]), metrics([401]), finished=True)
    assert not parts_dir(path).exists()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_a_refused_flush_stops_the_trace_with_one_warning(tmp_path, monkeypatch, caplog, code):
    from mpi4py import MPI

    from mpihybrid.trace.recorder import Recorder, StepWindow
    from mpihybrid.trace.stream import TraceStream

    path = tmp_path / "run.h5"
    recorder = Recorder(0, 0, 64, StepWindow(1, 0, 1))
    writer = TraceWriter(path, config="", attrs={"pp": 1})
    stream = TraceStream(MPI.COMM_SELF, recorder, writer, True, flush_steps=1)
    stream.begin(0.0)
    for step in range(2):
        stream.add_step(step, 1.0, 0.5)
        stream.flush()
    real = trace_file.atomic_path

    def full(target, overwrite=False):
        raise OSError(code, "No space left on device", str(target))

    monkeypatch.setattr(trace_file, "atomic_path", full)
    with caplog.at_level(logging.WARNING, logger="mpihybrid"):
        for step in range(2, 4):
            stream.add_step(step, 1.0, 0.5)
            stream.flush(finished=step == 3)  # nothing more is tried after the first refusal
    monkeypatch.setattr(trace_file, "atomic_path", real)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "training goes on" in warnings[0], warnings
    assert stream.stopped == "No space left on device"
    np.testing.assert_array_equal(load(path).steps["step"], [0, 1])  # up to the last flush
    with pytest.raises(OSError):  # a writer alone (write_trace, export) still raises
        monkeypatch.setattr(trace_file, "atomic_path", full)
        writer.flush(rows([4]), metrics([4]))


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (root only; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.mpi
def test_a_full_trace_disk_stops_the_trace_and_training_goes_on(small_disk):
    trace = small_disk / "t.h5"
    proc = run_mpi(2, "-m", "mpihybrid", "train", "--quiet", "--trace", str(trace),
                   "--set", "train.steps=60", "--set", "trace.flush_steps=1",
                   "--set", "model.hidden=8", "--set", "model.depth=2", timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("stopped:") == 1 and "No space left on device" in proc.stdout
    steps = load(trace).steps["step"]
    assert 0 < len(steps) < 60
    np.testing.assert_array_equal(steps, np.arange(len(steps)))


def test_the_flush_benchmark_runs_at_its_smallest():
    """benchmarks/trace_flush.py (figures are never asserted)."""
    import sys

    from tests.helpers import ROOT, mpi_env

    proc = subprocess.run([sys.executable, "benchmarks/trace_flush.py", "--steps", "3",
                           "--repeats", "1"], capture_output=True, text=True, cwd=ROOT,
                          env=mpi_env(), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "whole file / parts" in proc.stdout and proc.stdout.count(" MB") == 6
