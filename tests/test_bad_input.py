"""Bad input: one clear line, exit 2, every rank, no hang, nothing written."""

from __future__ import annotations

import pytest

from tests.helpers import run_mpi

pytestmark = pytest.mark.mpi


def train(n, *args, cwd=None):
    # no hang: a launch still running after 60 s raises TimeoutExpired, which fails the test
    return run_mpi(n, "-m", "mpihybrid", "train", "--quiet", *args, timeout=60, cwd=cwd)


@pytest.mark.parametrize(
    "n, args, message",
    [
        (8, ["--set", "grid.pp=4", "--set", "grid.dp=3"], "pp(4) * dp(3) = 12 != world size 8"),
        (4, ["--set", "train.global_batch=30"], "not divisible by dp(2) * microbatches(4) = 8"),
        (4, ["--set", "train.schedule=pipedream"], "train.schedule = 'pipedream': unknown"),
        (4, ["--set", "comm.codec=int4"], "comm.codec = 'int4': unknown"),
        (4, ["--set", "model.kind=cnn"], "model.kind = 'cnn': unknown"),
        (4, ["--set", "train.optimizer=lamb"], "train.optimizer = 'lamb': unknown"),
        (4, ["--set", "train.bogus=1"], "unknown key train.bogus"),
        (4, ["--set", "train.steps=many"], "expected int, got str"),
        (
            4,
            ["--set", "train.schedule=interleaved-1f1b", "--set", "train.virtual_stages=1"],
            "virtual",
        ),
        (2, ["--trace", "/nonexistent-dir/run.h5"], "/nonexistent-dir"),
        (2, ["jobs/does-not-exist.toml"], "does not exist"),
        (2, ["jobs"], "'jobs' is a directory"),
        (2, ["--set", "train.lr=nan"], "train.lr = nan: must be a finite number"),
        (2, ["--set", "train.momentum=-5"], "train.momentum = -5.0: must be in [0, 1)"),
        # os.access says yes to root everywhere; creating the temporary says no
        (2, ["--trace", "/proc/run.h5"], "cannot write /proc/run.h5"),
        (2, ["--set", "checkpoint.dir=/proc/ckpt"], "checkpoint.dir = '/proc/ckpt'"),
        (2, ["--set", "model.hidden=1000000000"], "the job needs about"),
        (2, ["--set", "comm.param_codec=int8"], "needs train.shard_optimizer = true"),
        (2, ["--set", "train.recompute=some"], "train.recompute = 'some': unknown"),
        (2, ["--set", "comm.timeout_s=1e-6"], "comm.timeout_s = 1e-06: below the watchdog's tick"),
        (
            2,
            ["--set", "train.shard_optimizer=true", "--set", "comm.param_codec=fp16"],
            "comm.param_codec = 'fp16': unknown",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(n, args, message):
    proc = train(n, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mpihybrid: error:") and message in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_malformed_toml(tmp_path):
    job = tmp_path / "bad.toml"
    job.write_text("[train]\nsteps = = 3\n")
    proc = train(2, str(job))
    assert proc.returncode == 2 and "not valid TOML" in proc.stderr


def test_existing_trace_is_not_overwritten(tmp_path):
    path = tmp_path / "run.h5"
    path.write_bytes(b"precious")
    proc = train(2, "--trace", str(path), "--set", "train.steps=1")
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert path.read_bytes() == b"precious"


def test_a_rank_failing_mid_run_ends_the_job(tmp_path):
    # a job left waiting would run into run_mpi's timeout (a hang guard, not a speed bound)
    proc = run_mpi(4, "tests/_mpi_fault.py", timeout=60, env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpihybrid: error:")]
    said = "mpihybrid: error: training failed on rank 1, step 1: RuntimeError: injected failure"
    assert len(lines) == 1 and lines[0].startswith(said), proc.stderr
    # an untraced run's record stays in the temporary directory, and the line says where
    (record,) = tmp_path.glob("mpihybrid-flight-*/rank1.h5")
    assert lines[0] == f"{said} (flight record: {record})"
    assert "Traceback" not in proc.stderr and "UnboundLocalError" not in proc.stderr


def test_debug_shows_the_failing_ranks_traceback():
    proc = run_mpi(4, "tests/_mpi_fault.py", timeout=60, env={"MPIHYBRID_DEBUG": "1"})
    assert proc.returncode == 1
    assert proc.stderr.count("Traceback") == 1 and "failing_forward" in proc.stderr


def test_a_rank_killed_by_the_os_ends_the_job():
    # a job left waiting would run into run_mpi's timeout (a hang guard, not a speed bound)
    proc = run_mpi(3, "tests/_mpi_inject.py", "kill", "train", "--quiet",
                   "--set", "model.hidden=16", timeout=60)  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("under", [False, True])
def test_checkpoint_dir_is_checked_before_training(tmp_path, under):
    """A regular file, or a path under one: refused at the start (exit 2), not when the first
    checkpoint (maybe the preemption's) is due."""
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    target = blocker / "ckpt" if under else blocker
    proc = train(2, "--set", f"checkpoint.dir={target}", "--set", "train.steps=1")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"checkpoint.dir = '{target}'" in lines[0], proc.stderr
    assert "step 1/" not in proc.stdout and blocker.read_text() == "mine"


def test_usage_error_is_printed_once():
    proc = run_mpi(2, "-m", "mpihybrid", "train", "--no-such-option", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("No such option") == 1, proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [(["--repeats", "0"], "0 is not in the range"), (["--sizes", "-4K"], "at least 4 bytes")],
)
def test_bench_allreduce_bad_arguments(args, message):
    proc = run_mpi(2, "-m", "mpihybrid", "bench", "allreduce", *args, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count(message) == 1 and "Traceback" not in proc.stderr, proc.stderr
