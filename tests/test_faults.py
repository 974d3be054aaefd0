"""Faults at the unit level (no mpiexec): files refused early and named as the user wrote them,
checkpoints moved aside, cleaned, verified and refused on a full disk, memory estimated."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from mpihybrid import files
from mpihybrid.config import load_job
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.model import build_stage
from mpihybrid.train import checkpoint
from mpihybrid.train.memory import rank_estimate


def test_probe_dir_creates_and_refuses(tmp_path):
    assert files.probe_dir(tmp_path / "a" / "b").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe leaves nothing behind
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError, match=f"{blocker} is a file"):
        files.probe_dir(blocker)
    with pytest.raises(NotADirectoryError, match="cannot create directory"):
        files.probe_dir(blocker / "sub")


def test_probe_file_creates_the_temporary_not_os_access(tmp_path):
    files.probe_file(tmp_path / "run.h5")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError, match="cannot write /proc/run.h5"):
        files.probe_file("/proc/run.h5")  # os.access(/proc, W_OK) is True for root


def test_atomic_write_names_the_users_path_not_the_temporary():
    with pytest.raises(OSError) as info:
        files.write_atomic("/proc/out.json", "{}")
    assert str(info.value).startswith("cannot write /proc/out.json:")
    assert ".tmp" not in str(info.value)


def test_a_step_dir_in_the_way_is_moved_aside(tmp_path):
    (tmp_path / "step-000004").mkdir()
    (tmp_path / "step-000004" / "stage-000.h5").write_bytes(b"half")
    partial = checkpoint.new_partial(tmp_path, 4)
    (partial / "stage-000.h5").write_bytes(b"new")
    final = checkpoint.commit(tmp_path, partial, 4, {"format": checkpoint.FORMAT}, keep=2)
    assert (final / "stage-000.h5").read_bytes() == b"new"
    (aside,) = tmp_path.glob("step-000004.moved-*")
    assert (aside / "stage-000.h5").read_bytes() == b"half"
    assert checkpoint.complete(tmp_path) == [final]  # the moved one never counts


def test_clean_partials_removes_only_partials(tmp_path):
    stale = tmp_path / ".step-000003.partial-deadbeef"
    stale.mkdir()
    (tmp_path / "step-000002").mkdir()
    assert checkpoint.clean_partials(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]


def test_a_full_disk_is_refused_before_hdf5_writes(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10, 10, 1000))
    with pytest.raises(OSError) as info:
        checkpoint.disk.check_space(tmp_path, needed=5000)
    assert info.value.errno == errno.ENOSPC
    line = checkpoint.disk.write_failed(info.value, tmp_path, 8, 5000)
    assert "no space left" in line and "4.88 KiB needed" in line and "1000 B free" in line


def test_damaged_file_is_detected_by_its_digest(tmp_path):
    (tmp_path / "stage-000.h5").write_bytes(b"0123456789")
    manifest = {"files": {"stage-000.h5": checkpoint.file_digest(tmp_path / "stage-000.h5")}}
    checkpoint.disk.verify(tmp_path, "stage-000.h5", manifest)
    (tmp_path / "stage-000.h5").write_bytes(b"0123456789"[::-1])
    with pytest.raises(checkpoint.CheckpointDamaged, match="stage-000.h5 is damaged"):
        checkpoint.disk.verify(tmp_path, "stage-000.h5", manifest)
    with pytest.raises(checkpoint.CheckpointDamaged, match="not in its manifest"):
        checkpoint.disk.verify(tmp_path, "stage-001.h5", manifest)


def test_unreadable_manifest_counts_as_damaged(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "mpihybrid-checkpoint", "st')
    with pytest.raises(checkpoint.CheckpointDamaged):
        checkpoint.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.read_manifest(tmp_path)
    assert not isinstance(info.value, checkpoint.CheckpointDamaged)  # refused, not skipped


@pytest.mark.parametrize("optimizer, state", [("sgd", 1), ("adamw", 2)])
def test_memory_estimate_counts_the_parameters_exactly(optimizer, state):
    job = load_job(None, [f"train.optimizer={optimizer}", "model.hidden=48"], 4)
    in_features, num_classes = task_dims(job.data)
    for pp_rank in range(job.grid.pp):
        stage = build_stage(job.model, in_features, num_classes, pp_rank, job.grid.pp, seed=0)
        need = rank_estimate(job, pp_rank)
        assert need["parameters"] == stage.flat_params.nbytes
        assert need["optimizer state"] == state * stage.flat_params.nbytes
        assert need["activations"] > 0


def test_memory_estimate_of_a_huge_model_is_huge_without_allocating():
    job = load_job(None, ["model.hidden=1000000000"], 2)
    assert rank_estimate(job, 0)["parameters"] > 10**18


def test_an_mpi_error_is_one_line_naming_the_rank():
    from mpi4py import MPI

    from mpihybrid.cli.commands import _one_line

    line = _one_line(MPI.Exception(MPI.ERR_OTHER))
    assert "stopped answering" in line and "\n" not in line
    assert _one_line(MemoryError("Unable to allocate 7 TiB")).startswith("out of memory")


def test_report_counts_the_steps_a_resumed_run_ran():
    from mpihybrid.train.report import format_report
    from mpihybrid.train.summary import Summary

    job = load_job(None, ["train.steps=10"], 2)
    summary = Summary(
        steps=10, runtime_s=1.0, samples_per_s=1.0, losses=[1.0], accuracies=[0.5],
        test_accuracy=0.5, bytes_sent={}, replica_max_diff={0: 0.0}, peak_inflight={},
        grid_as_run="", start=7,
    )  # fmt: skip
    text = format_report(job, summary)
    assert "for 3 steps" in text and "resumed            at step 7 of 10" in text


def test_nonfinite_gradient_sum_flags_nan_and_inf():
    from mpihybrid.train.state import nonfinite_stages

    Stage = namedtuple("Stage", "flat_grads")
    grads = {s: np.ones(1000, np.float32) for s in range(3)}
    grads[1][17], grads[2][999] = np.nan, -np.inf
    stages = {s: Stage(g) for s, g in grads.items()}
    assert nonfinite_stages(stages) == [1, 2]


def test_commit_fsyncs_files_manifest_directory_and_parent(tmp_path, monkeypatch):
    """After a node crash a renamed step-N/ must not hold empty files: every file, the manifest,
    the directory and its parent are flushed before (and after) the rename."""
    synced = []
    real_fsync, real_open = os.fsync, os.open
    names = {}

    def recording_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        names[fd] = Path(path)
        return fd

    def recording_fsync(fd):
        synced.append(names.get(fd))
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    partial = checkpoint.new_partial(tmp_path, 2)
    (partial / "stage-000.h5").write_bytes(b"weights")
    final = checkpoint.commit(tmp_path, partial, 2, {"format": checkpoint.FORMAT}, keep=2)
    synced_names = {p.name for p in synced if p is not None}
    assert {"stage-000.h5", partial.name, tmp_path.name} <= synced_names, synced_names
    assert any(p is not None and p.name.startswith(".manifest.json") for p in synced)
    assert (final / "manifest.json").is_file()
