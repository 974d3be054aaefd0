"""What a chaos soak found (issue 53): `why` tells a run's own flight records by the run's
identity (rank 0's start, broadcast), not by a time window, so a restart within seconds of a
stall is explained as itself; a rank stopped after the last step does not hang the job."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from mpihybrid.train.explain import explain, read_records
from mpihybrid.train.flight import FlightRecorder
from tests.helpers import ROOT, run_mpi


def _write(directory, rank, started, peer, reason):
    flight = FlightRecorder(rank, world_size=4, run_started=started)
    flight.begin("RECV_F", step=3, stage=0, microbatch=0, peer=peer, tag=5)
    flight.write(directory, reason)


def test_a_restart_within_a_second_is_another_run(tmp_path):
    directory = tmp_path / "run.flight"
    first = time.time() - 2.0
    for rank in (0, 1, 2):  # the first start: ranks 0-2 waited on rank 3
        _write(directory, rank, first, 3, "watchdog: first start")
    second = first + 1.0  # the restart, a second later: rank 2 alone waited, on rank 1
    _write(directory, 2, second, 1, "watchdog: second start")
    _, records, notes = read_records(directory)
    assert sorted(records) == [2], records
    assert notes and notes[0].startswith("left out: 2 record(s) of an earlier run (rank 0-1")
    text = "\n".join(explain(records))
    assert "second start" in text and "first start" not in text


@pytest.mark.mpi
def test_a_rank_stopped_after_the_last_step_does_not_hang_the_job():
    """Rank 1 stops itself (SIGSTOP) once training returned: the watchdog has stopped, and the
    job once waited for it for good. Now rank 0 ends it after comm.timeout_s (10 s at least),
    in one line."""
    proc = run_mpi(2, "tests/_mpi_inject.py", "stop-end", "train", "--quiet", "--set",
                   "model.hidden=16", "--set", "model.depth=4", "--set", "train.steps=3",
                   "--set", "comm.timeout_s=3", timeout=90)  # fmt: skip
    said = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode != 0, said
    assert "held-out accuracy" in proc.stdout, said  # the run itself finished and said so
    lines = [x for x in proc.stderr.splitlines() if x.startswith("mpihybrid: error:")]
    assert lines and "not every rank reached the end within 10 s after the run" in lines[0], said


def test_leftovers_removes_this_jobs_shm_and_hydra_files_only(tmp_path):
    """slurm/leftovers.sh (train.sbatch, before a requeue): this user's MPICH segments and hydra
    topology files changed since the step started go; older ones and other names stay."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir(), tmp.mkdir()
    old = shm / "mpich_shm_before"
    old.touch()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    since = int(time.time()) - 5
    for path in (shm / "mpich_shm_mine", shm / "not_mpich", tmp / "hydra_hwloc_xmlfile_ab"):
        path.touch()
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "leftovers.sh"), str(since)],
                          env={**os.environ, "SHM_DIR": str(shm), "TMPDIR": str(tmp)},
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in shm.iterdir()) == ["mpich_shm_before", "not_mpich"]
    assert list(tmp.iterdir()) == []
    assert "slurm/leftovers.sh" in (ROOT / "slurm" / "train.sbatch").read_text()


def test_a_failing_rank_waits_until_the_launcher_has_read_its_last_line():
    """_abort (abort_job, bound_the_exit) waits until the pipe to the launcher is read, not a
    fixed moment: a rank's last line was lost so in CI. Without a reader it gives up at its
    limit; on a file it asks nothing."""
    import threading

    from mpihybrid.cli.commands import _unread, drain_output

    read, write = os.pipe()
    try:
        os.write(write, b"mpihybrid: error: the last line\n")
        assert _unread(write) == 32
        drain_output(limit_s=0.3, fds=(write,))  # nobody reads: gives up
        assert _unread(write) == 32
        reader = threading.Timer(0.5, os.read, (read, 4096))
        reader.start()
        drain_output(limit_s=60.0, fds=(write,))
        assert _unread(write) == 0  # returned once the line was read, well before its limit
        reader.join()
    finally:
        os.close(read), os.close(write)
    with open(os.devnull, "w") as devnull:
        assert _unread(devnull.fileno()) is None
