"""Checkpoint / resume: bit-identical losses, preemption by signal, torn and foreign checkpoints."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from mpihybrid.trace.read import load
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


@pytest.fixture(scope="module")
def step5_once(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("step5") / "ckpt"
    proc = train(4, 5, "fp32", "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every=5",
                 opt="adamw")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return ckpt


@pytest.fixture
def step5(tmp_path, step5_once) -> Path:
    """A copy of one fp32 AdamW checkpoint at step 5 (pp = 2, dp = 2), this test's to resume."""
    return Path(shutil.copytree(step5_once, tmp_path / "ckpt"))


def test_resume_with_another_dp(tmp_path, reference, step5):
    """Replicas are identical, so a checkpoint taken at dp=2 continues at dp=1 (same pp)."""
    ckpt = step5
    trace = tmp_path / "dp1.h5"
    proc = train(2, STEPS, "fp32", "--set", f"checkpoint.dir={ckpt}", "--set", "grid.dp=1",
                 "--set", "train.global_batch=64", "--trace", str(trace), opt="adamw")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(losses(trace), reference["fp32"], rtol=1e-4)


def test_resume_at_another_dp_keeps_the_default_global_batch(tmp_path, reference, step5):
    """The default global batch follows dp (32 a replica); the resume keeps the checkpoint's
    64 at dp=1 (one line says so) instead of refusing a 'train.global_batch = 64 there, 32
    here' checkpoint."""
    ckpt = step5
    trace = tmp_path / "dp1.h5"
    proc = run_mpi(2, "-m", "mpihybrid", "train", "--set", f"train.steps={STEPS}",
                   "--set", "train.optimizer=adamw", "--set", f"checkpoint.dir={ckpt}",
                   "--set", "grid.pp=2", "--trace", str(trace), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    said = "train.global_batch = 64, as the checkpoint recorded (left at its default"
    assert said in proc.stdout + proc.stderr
    np.testing.assert_allclose(losses(trace), reference["fp32"], rtol=1e-4)
    bad = run_mpi(2, "-m", "mpihybrid", "train", "--set", "train.steps=12", "--set",
                  "train.optimizer=adamw", "--set", f"checkpoint.dir={ckpt}", "--set",
                  "grid.pp=2", "--set", "train.microbatches=5", timeout=60)  # fmt: skip
    assert bad.returncode == 2, bad.stderr
    assert "train.global_batch = 64 is the checkpoint's" in bad.stderr


def test_resume_switching_sharding_and_recompute_is_bit_identical(tmp_path, reference, step5):
    """Neither changes a bit with fp32, so a resume may switch both without --force."""
    ckpt = step5
    trace = tmp_path / "switched.h5"
    proc = train(4, STEPS, "fp32", "--set", f"checkpoint.dir={ckpt}", "--set",
                 "train.shard_optimizer=true", "--set", "train.recompute=full", "--trace",
                 str(trace), opt="adamw")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(losses(trace), reference["fp32"])


def test_preemption_signal_checkpoints_and_exits_3(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    cmd = mpi_command(4, "-m", "mpihybrid", "train", "--set", "train.steps=100000",
                      "--set", f"checkpoint.dir={ckpt}", "--set", "comm.codec=int8")  # fmt: skip
    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    seen = []
    for line in proc.stdout:  # training has started once rank 0 reports a step
        seen.append(line)
        if "step 1/" in line:
            break
    proc.send_signal(signal.SIGUSR1)  # mpiexec forwards it to every rank
    out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    out = "".join(seen) + out
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


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    proc = train(4, 2, "int8", "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every=2")
    assert proc.returncode == 0, proc.stderr
    return ckpt


@pytest.fixture
def saved(tmp_path, saved_once) -> Path:
    """A copy of one int8 checkpoint at step 2 (pp = 2, dp = 2), this test's to change."""
    return Path(shutil.copytree(saved_once, tmp_path / "ckpt"))


def _refused(ckpt, *extra, message):
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    proc = train(4, 4, "int8", "--set", f"checkpoint.dir={ckpt}", *extra)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == before  # nothing deleted


def test_checkpoint_of_another_model_is_refused(saved):
    _refused(saved, "--set", "model.hidden=32", message="has model.hidden = ")


def test_checkpoint_of_another_pp_is_refused(saved):
    _refused(saved, "--set", "grid.pp=1", "--set", "grid.dp=4", message="holds pp = 2 x 1 chunk(s)")


def test_torn_checkpoint_file_is_refused(saved):
    stage = checkpoint.latest(saved) / "stage-000.h5"
    stage.write_bytes(stage.read_bytes()[:200])
    _refused(saved, message="stage-000.h5 is damaged")


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


# ---- faults: every rank agrees, nothing is lost (issues #16 and #19) ----

TINY = ["--set", "model.hidden=16", "--set", "model.depth=4"]


def tiny(*args, script=(), n=2, timeout=60):
    """A 2-rank run of a tiny model; a hang fails the test (TimeoutExpired)."""
    argv = [*script] if script else ["-m", "mpihybrid"]
    return run_mpi(n, *argv, "train", "--quiet", *TINY, *args, timeout=timeout)


def inject(mode, *args):
    return tiny(*args, script=("tests/_mpi_inject.py", mode))


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("mpihybrid: error:")]


def test_incomplete_newer_step_dir_is_moved_aside_not_a_hang(tmp_path):
    """A step-N/ without manifest in the way of the run's checkpoint N: once a hang of every rank
    but rank 0 in save_all's bcast; now moved aside with a warning and the run goes on."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-000002").mkdir(parents=True)
    (ckpt / "step-000002" / "stage-000.h5").write_bytes(b"someone's half-written file")
    proc = tiny("--set", "train.steps=3", "--set", f"checkpoint.dir={ckpt}",
                "--set", "checkpoint.every=2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "incomplete: no manifest" in proc.stdout and "moved it aside" in proc.stdout
    assert checkpoint.latest(ckpt).name == "step-000002"
    (aside,) = ckpt.glob("step-000002.moved-*")
    assert (aside / "stage-000.h5").read_bytes() == b"someone's half-written file"


def test_commit_failing_on_rank_0_ends_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = inject("commit", "--set", "train.steps=4", "--set", f"checkpoint.dir={ckpt}",
                  "--set", "checkpoint.every=2")  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "checkpoint for step 2 not written" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(ckpt.iterdir()) == [], "the partial directory is removed"


def test_full_disk_keeps_the_earlier_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = inject("enospc", "--set", "train.steps=6", "--set", f"checkpoint.dir={ckpt}",
                  "--set", "checkpoint.every=2")  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert "checkpoint for step 4 not written" in lines[0] and "no space left" in lines[0]
    assert "needed for this checkpoint" in lines[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000002"]
    assert checkpoint.read_manifest(ckpt / "step-000002")["step"] == 2


def _flip_middle(path: Path, nbytes: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + nbytes] = bytes(b ^ 0xFF for b in data[middle : middle + nbytes])
    path.write_bytes(bytes(data))


def test_damaged_newest_checkpoint_falls_back_to_an_intact_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--set", f"checkpoint.dir={ckpt}"]
    assert tiny("--set", "train.steps=4", "--set", "checkpoint.every=2", *args).returncode == 0
    _flip_middle(ckpt / "step-000004" / "stage-001.h5")
    proc = tiny("--set", "train.steps=5", *args)
    assert proc.returncode == 0, proc.stderr
    assert "step-000004: stage-001.h5 is damaged" in proc.stdout
    assert f"resumed from {ckpt / 'step-000002'} (step 2)" in proc.stdout  # shown under --quiet
    assert "runtime" in proc.stdout and "for 3 steps" in proc.stdout  # 5 - 2, not 5
    _flip_middle(ckpt / "step-000002" / "stage-000.h5")
    proc = tiny("--set", "train.steps=5", "--resume", *args)
    assert proc.returncode == 2, proc.stderr
    (line,) = error_lines(proc)
    assert "no intact checkpoint to resume from" in line, proc.stderr


def test_missing_checkpoint_attribute_is_a_checkpoint_error(tmp_path):
    import h5py

    ckpt = tmp_path / "ckpt"
    args = ["--set", f"checkpoint.dir={ckpt}"]
    assert tiny("--set", "train.steps=2", "--set", "checkpoint.every=2", *args).returncode == 0
    path = ckpt / "step-000002"
    with h5py.File(path / "stage-001.h5", "a") as f:
        del f.attrs["optimizer_steps"]
    manifest = json.loads((path / "manifest.json").read_text())  # a consistent digest
    manifest["files"]["stage-001.h5"] = checkpoint.file_digest(path / "stage-001.h5")
    (path / "manifest.json").write_text(json.dumps(manifest))
    proc = tiny("--set", "train.steps=4", *args)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "optimizer_steps" in lines[0], proc.stderr


def test_stale_partial_directories_are_removed_at_start(tmp_path):
    ckpt = tmp_path / "ckpt"
    stale = ckpt / ".step-000009.partial-0123abcd"
    stale.mkdir(parents=True)
    (stale / "stage-000.h5").write_bytes(b"x" * 1000)
    proc = tiny("--set", "train.steps=1", "--set", f"checkpoint.dir={ckpt}")
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists() and "removed" in proc.stdout


def test_diverging_run_stops_and_never_checkpoints_nan(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = tiny("--set", "train.steps=20", "--set", "train.lr=1e12", "--set",
                f"checkpoint.dir={ckpt}", "--set", "checkpoint.every=1")  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    (line,) = error_lines(proc)
    assert re.search(r"step (\d+): the loss is nan \(stage 1, the last\)", line), line
    stopped = int(re.search(r"step (\d+)", line).group(1))
    latest = checkpoint.latest(ckpt)
    assert latest is None or checkpoint.read_manifest(latest)["step"] < stopped
    for path in checkpoint.complete(ckpt):
        assert all(np.isfinite(checkpoint.read_manifest(path)["losses"]))


def test_nonfinite_gradient_names_step_and_stage(tmp_path):
    proc = inject("nan-grad", "--set", "train.steps=6")
    assert proc.returncode == 1, proc.stderr
    (line,) = error_lines(proc)
    assert "step 3: the gradient of stage 0 is not finite" in line, line


def test_preemption_signal_without_checkpoint_dir_warns_once():
    proc = inject("usr1", "--set", "train.steps=4")
    assert proc.returncode == 0, proc.stderr
    warning = "preemption signal received but checkpoint.dir is not set"
    assert proc.stdout.count(warning) == 1, proc.stdout
