"""A trace written as the run goes: flushes that each leave a valid file, a bounded recorder,
trace windows, a preempted run's trace kept and continued by the resumed run."""

from __future__ import annotations

import signal
import subprocess
import time

import h5py
import numpy as np
import pytest

from mpihybrid.config import Job, TraceConfig, TrainConfig
from mpihybrid.trace.file import TraceWriter, write_trace
from mpihybrid.trace.read import load
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND, Recorder, StepWindow
from tests.helpers import ROOT, mpi_command, mpi_env, run_mpi


def rows(steps, per_step=3, t0=0.0) -> np.ndarray:
    out = np.zeros(len(steps) * per_step, EVENT_DTYPE)
    out["step"] = np.repeat(steps, per_step)
    out["kind"] = KIND["forward"]
    out["start"] = t0 + np.arange(len(out), dtype=float)
    out["end"] = out["start"] + 0.5
    return out


def metrics(steps) -> dict:
    steps = np.asarray(steps, np.int64)
    return {
        "step": steps,
        "loss": 1.0 / (1 + steps),
        "accuracy": steps / 10,
        "step_time": steps * 0.0 + 1,
    }


def test_every_flush_leaves_a_whole_trace(tmp_path):
    path = tmp_path / "run.h5"
    writer = TraceWriter(
        path, config="[train]\nsteps = 4\n", attrs={"pp": 2, "hostnames": ["a", "b"]}
    )
    writer.start()
    writer.flush(rows([]), {})
    assert len(load(path).events) == 0 and load(path).attrs["finished"] is False
    writer.flush(rows([0, 1]), metrics([0, 1]))
    middle = load(path)  # what a reader sees while the run goes on
    assert len(middle.events) == 6 and middle.attrs["finished"] is False
    np.testing.assert_array_equal(middle.steps["step"], [0, 1])
    writer.flush(rows([2, 3], t0=6), metrics([2, 3]), attrs={"runtime_s": 1.5}, finished=True)
    final = load(path)
    assert len(final.events) == 12 and final.attrs["finished"] is True
    assert final.attrs["runtime_s"] == 1.5 and final.attrs["hostnames"] == ["a", "b"]
    np.testing.assert_array_equal(final.steps["step"], [0, 1, 2, 3])
    assert [p.name for p in tmp_path.iterdir()] == ["run.h5"]  # no temporary left behind


def test_rows_of_a_skewed_clock_are_kept_in_the_formats_order(tmp_path):
    """/events is sorted by (start, rank). A flush's rows are, but a rank's estimated clock
    offset can put its last rows of one flush after another's first of the next (a loaded CI
    run's resumed trace): the reader sorts across parts, a publish rewrites the table in order."""
    path = tmp_path / "run.h5"
    writer = TraceWriter(path, config="", attrs={})
    writer.start()
    first = rows([0, 1])
    first["rank"][-1] = 1  # rank 1's last row of the flush, at 5.0
    writer.flush(first, metrics([0, 1]))
    early = rows([2], t0=4.5)  # rank 0's first row of the next flush reads 4.5
    for flush in (early[:1], early[1:]):
        writer.flush(flush, metrics([]))  # parts, after the file
        middle = load(path).events
        assert np.all(np.diff(middle["start"]) >= 0), middle["start"]
    writer.flush(rows([3], t0=10), metrics([2, 3]), finished=True)  # published: one file
    with h5py.File(path) as f:
        starts = f["events"]["start"]
    assert len(starts) == 12 and np.all(np.diff(starts) >= 0), starts
    assert [p.name for p in tmp_path.iterdir()] == ["run.h5"]


def test_a_resumed_writer_continues_the_trace(tmp_path):
    path = tmp_path / "run.h5"
    write_trace(path, events=rows([0, 1, 2]), steps=metrics([0, 1, 2]), config="", attrs={})
    writer = TraceWriter(path, config="", attrs={})
    # the checkpoint was of step 2: step 2 (index 2) runs again and its old rows go
    writer.start(resume_step=2, earlier_steps={"loss": [9.0, 9.0], "accuracy": [0.0, 0.0]})
    writer.flush(rows([2, 3]), metrics([2, 3]), finished=True)
    trace = load(path)
    np.testing.assert_array_equal(trace.steps["step"], [0, 1, 2, 3])
    np.testing.assert_array_equal(trace.steps["loss"][:2], [1.0, 0.5])  # the trace's own rows
    assert np.count_nonzero(trace.events["step"] == 2) == 3
    assert np.all(np.diff(trace.events["start"]) >= 0)  # times go on after the earlier part


def test_a_resume_without_earlier_trace_keeps_the_checkpoint_losses(tmp_path):
    path = tmp_path / "run.h5"
    writer = TraceWriter(path, config="", attrs={})
    writer.start(resume_step=2, earlier_steps={"loss": [3.0, 2.0], "accuracy": [0.1, 0.2]})
    writer.flush(rows([2]), metrics([2]), finished=True)
    trace = load(path)
    np.testing.assert_array_equal(trace.steps["loss"], [3.0, 2.0, 1 / 3])
    assert np.isnan(trace.steps["step_time"][:2]).all()


def test_version_1_traces_still_read(tmp_path):
    path = tmp_path / "old.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(format="mpihybrid-trace", schema_version=1, complete=True, json_attrs=[])
        f.create_dataset("events", data=rows([0, 1]))
        f.create_group("steps").create_dataset("loss", data=[2.0, 1.0])
        f.create_dataset("config", data="", dtype=h5py.string_dtype())
    trace = load(path)
    assert trace.attrs["finished"] is True
    np.testing.assert_array_equal(trace.step_numbers(), [0, 1])


def test_window_and_every_kth_step():
    rec = Recorder(0, 0, capacity=1, window=StepWindow(first=3, last=8, every=2))
    for step in range(10):
        rec.record(KIND["forward"], step, 0, 0, 0.0, 1.0)
        rec.record(KIND["step"], step, -1, -1, 0.0, 2.0 + step)
    # 1-based steps 3, 5, 7 are the 0-based 2, 4, 6
    assert sorted(set(rec.events["step"].tolist())) == [2, 4, 6]
    assert rec.last_step_time == 11.0  # known for every step, traced or not
    rec.clear()
    assert len(rec) == 0


class _OneRank:
    rank = 0

    def gather(self, value, root=0):
        return [value]

    def Get_size(self):
        return 1


@pytest.mark.parametrize("path", ["", "run.h5"])
def test_a_billion_steps_allocate_a_small_buffer(tmp_path, path):
    from mpihybrid.train.tracing import build_trace

    job = Job(
        train=TrainConfig(steps=1_000_000_000),
        trace=TraceConfig(path=str(tmp_path / path) if path else ""),
    )
    recorder, stream = build_trace(job, _OneRank(), 0, 40)
    assert recorder.capacity * EVENT_DTYPE.itemsize < 2**24  # was 40 rows x 1e9 steps


def _trace_steps(path) -> int:
    try:
        return len(load(path).steps.get("step", []))
    except Exception:  # not written yet, or replaced under our feet: try again
        return 0


@pytest.mark.mpi
def test_a_preempted_run_keeps_its_trace_and_the_resumed_run_continues_it(tmp_path):
    trace, ckpt = tmp_path / "run.h5", tmp_path / "ckpt"
    args = ["-m", "mpihybrid", "train", "--quiet", "--trace", str(trace),
            "--set", f"checkpoint.dir={ckpt}", "--set", "trace.flush_steps=5"]  # fmt: skip
    cmd = mpi_command(2, *args, "--set", "train.steps=1000000")
    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while _trace_steps(trace) < 10 and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the file the run writes
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    stopped = load(trace)
    n = stopped.attrs["stopped_at_step"]
    assert stopped.attrs["finished"] is False and n >= 10
    np.testing.assert_array_equal(stopped.steps["step"], np.arange(n))
    assert stopped.events["step"].max() == n - 1

    resumed = run_mpi(2, *args, "--set", f"train.steps={n + 3}")
    assert resumed.returncode == 0, resumed.stderr
    trace_after = load(trace)
    assert trace_after.attrs["finished"] is True
    np.testing.assert_array_equal(trace_after.steps["step"], np.arange(n + 3))
    np.testing.assert_array_equal(trace_after.steps["loss"][:n], stopped.steps["loss"])
    assert sorted(set(trace_after.events["step"].tolist())) == list(range(n + 3))
    assert np.all(np.diff(trace_after.events["start"]) >= 0)


def test_more_ranks_than_cores_is_warned_once_with_the_numbers(caplog):
    from mpihybrid.train import tracing

    assert tracing.oversubscribed([("a", 2), ("a", 2), ("b", 4)]) is None
    message = tracing.oversubscribed([("vm", 2)] * 12)
    assert "12 ranks on vm, which has 2 cores" in message and "at most 2 ranks" in message
    tracing._oversubscription_told = False
    with caplog.at_level("WARNING", logger="mpihybrid"):
        tracing.warn_oversubscribed([("vm", 2)] * 3)
        tracing.warn_oversubscribed([("vm", 2)] * 3)
    assert [r.getMessage().startswith("oversubscribed: 3 ranks") for r in caplog.records] == [True]
