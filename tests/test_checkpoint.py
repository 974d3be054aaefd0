"""Checkpoint / resume: bit-identical losses, preemption by signal, torn and foreign checkpoints."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from mpihybrid.trace.file import load
from mpihybrid.train import checkpoint
from tests.helpers import ROOT, mpi_command, mpi_env, run_mpi

pytestmark = pytest.mark.mpi

STEPS = 10
BASE = ["--quiet", "--set", "train.steps={steps}", "--set", "train.optimizer={opt}"]


def train(n, steps, codec, *extra, opt="sgd"):
    args = [a.format(steps=steps, opt=opt) for a in BASE]
    proc = run_mpi(
        n, "-m", "mpihybrid", "train", *args, "--set", f"comm.codec={codec}", *extra, timeout=120
    )
    return proc


def losses(path) -> np.ndarray:
    return load(path).steps["loss"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per (codec, optimizer)."""
    out = {}
    root = tmp_path_factory.mktemp("reference")
    for codec, opt in [("fp32", "adamw"), ("int8", "sgd")]:
        path = root / f"{codec}.h5"
        proc = train(4, STEPS, codec, "--trace", str(path), opt=opt)
        assert proc.returncode == 0, proc.stderr
        out[codec] = losses(path)
    return out


@pytest.mark.parametrize("codec, opt", [("fp32", "adamw"), ("int8", "sgd")])
@pytest.mark.parametrize("stop", [3, 7])
def test_resume_is_bit_identical(tmp_path, reference, codec, opt, stop):
    ckpt = tmp_path / "ckpt"
    first = train(4, stop, codec, "--set", f"checkpoint.dir={ckpt}",
                  "--set", f"checkpoint.every={stop}", opt=opt)  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert checkpoint.latest(ckpt).name == f"step-{stop:06d}"
    trace = tmp_path / "resumed.h5"
    second = train(4, STEPS, codec, "--resume", "--set", f"checkpoint.dir={ckpt}",
                   "--trace", str(trace), opt=opt)  # fmt: skip
    assert second.returncode == 0, second.stderr
    resumed = losses(trace)
    print(codec, opt, "stop", stop, "max |loss diff| =", np.max(np.abs(resumed - reference[codec])))
    np.testing.assert_array_equal(resumed, reference[codec])


def test_resume_with_another_dp(tmp_path, reference):
    """Replicas are identical, so a checkpoint taken at dp=2 continues at dp=1 (same pp)."""
    ckpt = tmp_path / "ckpt"
    assert train(4, 5, "fp32", "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every=5",
                 opt="adamw").returncode == 0  # fmt: skip
    trace = tmp_path / "dp1.h5"
    proc = train(2, STEPS, "fp32", "--set", f"checkpoint.dir={ckpt}", "--set", "grid.dp=1",
                 "--set", "train.global_batch=64", "--trace", str(trace), opt="adamw")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(losses(trace), reference["fp32"], rtol=1e-4)


def test_preemption_signal_checkpoints_and_exits_3(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    cmd = mpi_command(4, "-m", "mpihybrid", "train", "--quiet", "--set", "train.steps=100000",
                      "--set", f"checkpoint.dir={ckpt}", "--set", "comm.codec=int8")  # fmt: skip
    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    time.sleep(2)  # let training start
    proc.send_signal(signal.SIGUSR1)  # mpiexec forwards it to every rank
    out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    assert proc.returncode == 3, out
    assert "preempted at step" in out
    path = checkpoint.latest(ckpt)
    step = checkpoint.read_manifest(path)["step"]
    assert 0 < step < 100000
    # the preempted run continues exactly where the uninterrupted one would be
    trace = tmp_path / "after.h5"
    proc = train(4, step + 2, "int8", "--set", f"checkpoint.dir={ckpt}", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    assert len(losses(trace)) == step + 2


def test_kill_9_during_a_checkpoint_leaves_the_previous_one(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    proc = run_mpi(
        4, "tests/_mpi_kill_in_checkpoint.py", "train", "--quiet",
        "--set", f"train.steps={STEPS}", "--set", "comm.codec=int8",
        "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every=4", timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert checkpoint.latest(ckpt).name == "step-000004"
    assert list(ckpt.glob(".step-000008.partial-*")), "the torn write stays aside"
    trace = tmp_path / "resumed.h5"
    proc = train(4, STEPS, "int8", "--set", f"checkpoint.dir={ckpt}", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(losses(trace), reference["int8"])


@pytest.fixture
def saved(tmp_path) -> Path:
    ckpt = tmp_path / "ckpt"
    proc = train(4, 2, "int8", "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every=2")
    assert proc.returncode == 0, proc.stderr
    return ckpt


def _refused(ckpt, *extra, message):
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    proc = train(4, 4, "int8", "--set", f"checkpoint.dir={ckpt}", *extra)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == before  # nothing deleted


def test_checkpoint_of_another_model_is_refused(saved):
    _refused(saved, "--set", "model.hidden=32", message="has model =")


def test_checkpoint_of_another_pp_is_refused(saved):
    _refused(saved, "--set", "grid.pp=1", "--set", "grid.dp=4", message="has pp = 2")


def test_torn_checkpoint_file_is_refused(saved):
    stage = checkpoint.latest(saved) / "stage-000.h5"
    stage.write_bytes(stage.read_bytes()[:200])
    _refused(saved, message="torn")


def test_foreign_manifest_is_refused(saved):
    manifest = checkpoint.latest(saved) / "manifest.json"
    manifest.write_text(json.dumps({"format": "something-else"}))
    _refused(saved, message="not an mpihybrid checkpoint")


def test_resume_without_checkpoint_is_refused(tmp_path):
    proc = train(2, 2, "fp32", "--resume", "--set", f"checkpoint.dir={tmp_path / 'none'}")
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr


def test_keep_prunes_old_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = train(2, 6, "fp32", "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every=1",
                 "--set", "checkpoint.keep=2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000005", "step-000006"]
