"""A run owns its files: one run per checkpoint.dir and trace path (a lock the kernel drops when
its holder dies), another job's checkpoint or trace refused, stale temporaries removed."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mpihybrid import files
from mpihybrid.config import load_job
from mpihybrid.files import LockedError, acquire_lock, clean_stale_temporaries, lock_path_for
from mpihybrid.train.checkpoint import job_differences
from tests.helpers import mpi_env, run_mpi

HOLD = (
    "import sys, time; from mpihybrid.files import acquire_lock; "
    "acquire_lock(sys.argv[1], 'x', is_dir=True); print('held', flush=True); time.sleep(60)"
)


@pytest.fixture(autouse=True)
def _release():
    yield
    files.release_all()


def _holder(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
        env=mpi_env(),
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_is_refused_naming_its_holder_and_released_at_exit(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(LockedError) as err:
            acquire_lock(tmp_path, f"checkpoint.dir {tmp_path}", is_dir=True)
        message = str(err.value)
        assert f"pid {proc.pid} on {socket.gethostname()}" in message
        assert "in use by another run" in message and "\n" not in message
        assert err.value.errno == errno.EBUSY
    finally:
        proc.kill()  # kill -9: no clean-up runs, the lock file stays behind
        proc.wait()
    assert lock_path_for(tmp_path, True).exists()
    lock = acquire_lock(tmp_path, "x", is_dir=True)  # the kernel dropped the dead one's lock
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock.path.exists()


def test_two_locks_in_one_process_are_one(tmp_path):
    assert acquire_lock(tmp_path / "t.h5", "trace") is acquire_lock(tmp_path / "t.h5", "trace")
    assert (tmp_path / ".t.h5.lock").exists()


def _no_flock(monkeypatch):
    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(files.fcntl, "flock", refuse)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_holder(tmp_path, **holder) -> Path:
    path = lock_path_for(tmp_path, True)
    base = {"host": socket.gethostname(), "pid": 1, "start": "", "slurm_job": "", "since": "x"}
    path.write_text(json.dumps(base | holder))
    return path


@pytest.mark.parametrize(
    "holder, stale",
    [
        ({"pid": "dead"}, True),  # this host, the pid is gone
        ({"pid": "parent"}, False),  # this host, alive
        ({"pid": "parent", "start": "1"}, True),  # the pid now belongs to a later process
        ({"host": "elsewhere", "pid": "dead"}, False),  # another host cannot be asked
        ({"host": "elsewhere", "slurm_job": "777"}, True),  # this SLURM job before its requeue
    ],
)
def test_without_flock_the_lock_file_is_the_lock(tmp_path, monkeypatch, holder, stale):
    """NFSv3 without lockd, Lustre without -o flock: O_EXCL and the holder's identity."""
    _no_flock(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    pids = {"dead": _dead_pid(), "parent": os.getppid()}
    holder["pid"] = pids.get(holder.get("pid"), 1)
    _write_holder(tmp_path, **holder)
    if stale:
        lock = acquire_lock(tmp_path, "x", is_dir=True)
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    else:
        with pytest.raises(LockedError, match="in use by another run"):
            acquire_lock(tmp_path, "x", is_dir=True)


def test_only_our_stale_temporaries_are_removed(tmp_path):
    dead, alive = _dead_pid(), os.getppid()
    names = [
        f".t.h5.{dead}.0123abcd.tmp",  # a dead writer's: removed
        f".t.h5.{alive}.0123abcd.tmp",  # a live writer's: kept
        f".other.h5.{dead}.0123abcd.tmp",  # another file's: kept
        f".t.h5.{dead}.notours.tmp",  # not our pattern: kept
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = clean_stale_temporaries(tmp_path / "t.h5")
    assert removed == [tmp_path / names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_job_differences_name_what_a_resume_may_not_change():
    from mpihybrid.config import to_toml

    job = load_job(None, ["train.steps=10"], 2)
    assert job_differences(to_toml(job), job) == []
    longer = load_job(None, ["train.steps=50", "comm.codec=int8", "trace.path='x.h5'"], 2)
    assert job_differences(to_toml(job), longer) == []
    other = load_job(None, ["data.seed=7", "train.lr=0.5"], 2)
    found = job_differences(to_toml(job), other)
    assert found == ["data.seed = 1234 there, 7 here", "train.lr = 0.01 there, 0.5 here"]
    assert job_differences("not = [toml", job) == ["its stored job is not readable TOML"]


TINY = ["--quiet", "--set", "train.steps=4", "--set", "model.hidden=8", "--set", "model.depth=2"]


def _train(tmp_path, *extra, n=1):
    return run_mpi(n, "-m", "mpihybrid", "train", *TINY, *extra, timeout=60, cwd=tmp_path)


@pytest.mark.mpi
def test_a_second_run_on_a_locked_checkpoint_dir_or_trace_exits_2_on_every_rank(tmp_path):
    (tmp_path / "ck").mkdir()
    lock = acquire_lock(tmp_path / "ck", "checkpoint.dir ck", is_dir=True)
    proc = _train(tmp_path, "--set", "checkpoint.dir='ck'", n=2)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("mpihybrid: error:") == 1
    assert "checkpoint.dir = 'ck'" in proc.stderr and f"pid {os.getpid()}" in proc.stderr
    lock.release()
    acquire_lock(tmp_path / "t.h5", "trace t.h5")
    proc = _train(tmp_path, "--trace", "t.h5")
    assert proc.returncode == 2 and "trace t.h5 is in use by another run" in proc.stderr
    assert not (tmp_path / "t.h5").exists()


@pytest.mark.mpi
def test_another_jobs_checkpoint_or_trace_is_refused_naming_the_difference(tmp_path):
    ck = ["--set", "checkpoint.dir='ck'", "--set", "checkpoint.every=2"]
    assert _train(tmp_path, *ck, "--trace", "mine.h5").returncode == 0
    assert not (tmp_path / "ck" / ".lock").exists() and not (tmp_path / ".mine.h5.lock").exists()
    # a resume (train.steps=6) with another data.seed: refused, named; --force goes on
    proc = _train(tmp_path, *ck, "--set", "train.steps=6", "--set", "data.seed=9")
    assert proc.returncode == 2
    assert "data.seed = 1234 there, 9 here" in proc.stderr and "--force" in proc.stderr
    # another finished run's trace adopted by a resume: refused without --overwrite
    assert _train(tmp_path, "--trace", "other.h5", "--set", "train.lr=0.2").returncode == 0
    proc = _train(tmp_path, *ck, "--set", "train.steps=6", "--trace", "other.h5")
    assert proc.returncode == 2 and "trace other.h5 is another run's" in proc.stderr
    assert "checkpoint.dir = '' there, 'ck' here" in proc.stderr
    # its own trace continues
    proc = _train(tmp_path, *ck, "--set", "train.steps=6", "--trace", "mine.h5")
    assert proc.returncode == 0, proc.stderr
    from mpihybrid.trace.read import load

    assert list(load(tmp_path / "mine.h5").steps["step"]) == list(range(6))
    proc = _train(tmp_path, *ck, "--set", "train.steps=8", "--set", "data.seed=9", "--force")
    assert proc.returncode == 0, proc.stderr
