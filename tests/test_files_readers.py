"""Crafted and damaged files refused before they cost anything: a trace or checkpoint whose
declared sizes the file does not hold, data kept elsewhere (external storage, virtual datasets,
soft and external links), attributes and values out of range. Each file is made here with h5py."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from mpihybrid.trace.file import write_trace
from mpihybrid.trace.read import TraceError, load
from mpihybrid.trace.recorder import EVENT_DTYPE
from mpihybrid.train import checkpoint
from tests.helpers import mpi_env

ATTRS = {"world_size": 2, "pp": 2, "dp": 1, "microbatches": 2, "virtual_stages": 1}


def good_trace(path, rows: int = 8):
    events = np.zeros(rows, EVENT_DTYPE)
    events["rank"] = np.arange(rows) % 2
    events["stage"] = np.arange(rows) % 2
    events["start"] = np.arange(rows, dtype=float)
    events["end"] = events["start"] + 0.5
    events["peer"] = -1
    steps = {"step": np.arange(2), "loss": np.array([1.0, np.nan])}  # a nan loss is a real stop
    write_trace(path, events=events, steps=steps, config="", attrs=dict(ATTRS))
    return path


def refused(path, match: str):
    with pytest.raises(TraceError, match=match) as err:
        load(path)
    assert "\n" not in str(err.value)


def test_a_good_trace_reads(tmp_path):
    trace = load(good_trace(tmp_path / "t.h5"))
    assert len(trace.events) == 8 and np.isnan(trace.steps["loss"][1])


def test_declared_rows_the_file_does_not_hold_are_refused_before_reading(tmp_path):
    """64 KB declaring 2^27 event rows (6 GB): refused, nothing allocated."""
    path = good_trace(tmp_path / "t.h5")
    with h5py.File(path, "a") as f:
        del f["events"]
        f.create_dataset("events", shape=(1 << 27,), dtype=EVENT_DTYPE, chunks=(8192,),
                         maxshape=(None,), compression="gzip")  # fmt: skip
    assert path.stat().st_size < 1 << 20
    refused(path, "/events declares")


def test_a_contiguous_dataset_larger_than_the_file_is_refused(tmp_path):
    path = good_trace(tmp_path / "t.h5")
    with h5py.File(path, "a") as f:
        del f["steps/loss"]
        f.create_dataset("steps/loss", shape=(1 << 30,), dtype="f8")  # 8 GiB, never written
    refused(path, "/steps/loss declares")


@pytest.mark.parametrize("target", ["/etc/passwd", "fifo"])
def test_external_storage_is_refused_without_reading_it(tmp_path, target):
    """A FIFO would block the reader forever; /etc/passwd would be read as rank numbers."""
    if target == "fifo":
        target = str(tmp_path / "fifo")
        os.mkfifo(target)
    path = good_trace(tmp_path / "t.h5")
    with h5py.File(path, "a") as f:
        del f["events"]
        f.create_dataset("events", shape=(64,), dtype=EVENT_DTYPE,
                         external=[(target, 0, h5py.h5f.UNLIMITED)])  # fmt: skip
    refused(path, "external files")


def test_a_virtual_dataset_is_refused(tmp_path):
    other = good_trace(tmp_path / "other.h5")
    path = good_trace(tmp_path / "t.h5")
    layout = h5py.VirtualLayout(shape=(8,), dtype=EVENT_DTYPE)
    layout[:] = h5py.VirtualSource(str(other), "events", shape=(8,))
    with h5py.File(path, "a") as f:
        del f["events"]
        f.create_virtual_dataset("events", layout)
    refused(path, "virtual dataset")


@pytest.mark.parametrize("kind", ["soft", "external"])
def test_links_are_refused(tmp_path, kind):
    other = good_trace(tmp_path / "other.h5")
    path = good_trace(tmp_path / "t.h5")
    with h5py.File(path, "a") as f:
        f["real"] = f["events"][...]
        del f["events"]
        f["events"] = h5py.SoftLink("/real") if kind == "soft" else h5py.ExternalLink(
            str(other), "/events")  # fmt: skip
    refused(path, f"/events is an? {kind} link")


@pytest.mark.parametrize(
    "attrs, match",
    [
        ({"pp": 1000000}, r"pp = 1000000 is out of range"),
        ({"world_size": 1 << 40}, "world_size"),
        ({"microbatches": 1 << 30}, "microbatches"),
        ({"pp": 2.5}, "is not an integer"),
        ({"dp": 2}, r"pp\(2\) \* dp\(2\) != world_size\(2\)"),
        ({"stage_ranks": np.array([0, 7])}, "stage_ranks is not 2 pp ranks below pp"),
        ({"stage_ranks": np.array([0, 1, 1])}, "stage_ranks"),
    ],
)
def test_attributes_out_of_range_are_refused(tmp_path, attrs, match):
    path = good_trace(tmp_path / "t.h5")
    with h5py.File(path, "a") as f:
        for name, value in attrs.items():
            f.attrs[name] = value
    refused(path, match)


@pytest.mark.parametrize(
    "column, value, match",
    [
        ("start", np.nan, "non-finite time"),
        ("end", np.inf, "non-finite time"),
        ("rank", 2, "names a rank past 2"),
        ("peer", 7, "names a peer past 2"),
        ("stage", 9, "names a stage past 2"),
        ("kind", 200, "unknown kind"),
        ("step", -3, "negative step"),
    ],
)
def test_event_values_out_of_range_are_refused(tmp_path, column, value, match):
    path = good_trace(tmp_path / "t.h5")
    with h5py.File(path, "a") as f:
        rows = f["events"][...]
        rows[5][column] = value
        f["events"][...] = rows
    refused(path, f"event row 5 (has an? )?{match}")


def test_a_fifo_is_not_opened(tmp_path):
    os.mkfifo(tmp_path / "t.h5")
    refused(tmp_path / "t.h5", "not a regular file")


def test_analyze_of_a_crafted_trace_is_one_line_and_exit_2(tmp_path):
    path = good_trace(tmp_path / "t.h5")
    with h5py.File(path, "a") as f:
        f.attrs["pp"] = 1000000
    proc = subprocess.run([sys.executable, "-m", "mpihybrid", "analyze", str(path)],
                          capture_output=True, text=True, env=mpi_env(), timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "out of range" in proc.stderr


# checkpoints: the stage file of a resume


def stage_file(path, params):
    with h5py.File(path, "w") as f:
        f.attrs["format"] = checkpoint.FORMAT
        f.attrs["optimizer_steps"] = 1
        if params is not None:
            f.create_dataset("params", data=params)
    return path


def test_a_checkpoint_dataset_declaring_8_gib_is_refused_unread(tmp_path):
    path = stage_file(tmp_path / "stage-000.h5", None)
    with h5py.File(path, "a") as f:
        f.create_dataset("params", shape=(1 << 31,), dtype="f4")  # 8 GiB, file ~ 2 KB
    with pytest.raises(checkpoint.CheckpointError, match="params declares 8589934592 bytes"):
        checkpoint.disk.read_h5(path)


def test_checkpoint_data_in_external_storage_is_refused(tmp_path):
    """Bytes beside the checkpoint would escape its sha256."""
    outside = tmp_path / "outside.bin"
    np.ones(16, np.float32).tofile(outside)
    path = stage_file(tmp_path / "stage-000.h5", None)
    with h5py.File(path, "a") as f:
        f.create_dataset("params", shape=(16,), dtype="f4", external=[(str(outside), 0, 64)])
    with pytest.raises(checkpoint.CheckpointError, match="external files"):
        checkpoint.disk.read_h5(path)


def test_checkpoint_parameters_with_nan_are_refused(tmp_path):
    class Stage:
        flat_params = np.zeros(4, np.float32)

    stage_file(tmp_path / "stage-000.h5", np.array([1, np.nan, 0, 0], np.float32))
    with pytest.raises(checkpoint.CheckpointError, match="nan or inf"):
        state = SimpleNamespace(index=0, stage=Stage(), optimizer=None, reducer=None, sharded=False)
        checkpoint.load_rank(tmp_path, state, dp_rank=0, same_dp=True)
