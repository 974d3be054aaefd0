"""Bad input: one clear line, exit 2, every rank, no hang, nothing written."""

from __future__ import annotations

import time

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
    t0 = time.monotonic()
    proc = run_mpi(4, "tests/_mpi_fault.py", timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "injected failure" in proc.stderr
    assert elapsed < 30, elapsed
