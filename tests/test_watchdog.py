"""No job hangs: interrupts, a stalled rank, a rank that leaves alone, signals after the last
step, MPI_Finalize after shared windows; the flight record and `mpihybrid why`."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mpihybrid.cli.why import why
from mpihybrid.config import ConfigError, load_job
from mpihybrid.progress import progress
from mpihybrid.trace.read import load
from mpihybrid.train import checkpoint, memory
from mpihybrid.train.explain import explain, read_records
from mpihybrid.train.flight import FLIGHT_ROWS, FlightRecorder, record_dir
from mpihybrid.train.watchdog import Watchdog
from tests.helpers import ROOT, flavour, mpi_command, mpi_env, run_mpi

TINY = ["--set", "model.hidden=16", "--set", "model.depth=4"]


# ---- the flight recorder and the watchdog, without MPI ----


def test_flight_record_keeps_the_last_rows_and_names_the_open_one():
    flight = FlightRecorder(rank=2, pp_rank=1, dp_rank=0, world_size=4)
    for n in range(FLIGHT_ROWS + 88):
        flight.end(flight.begin("F", step=n + 1, stage=1, microbatch=n % 4))
    i = flight.begin("RECV_B", step=700, stage=1, microbatch=3, peer=3, tag=11)
    rows = flight.to_array()
    assert len(rows) == FLIGHT_ROWS
    assert rows["step"][0] == 90 and rows["step"][-1] == 700  # the oldest kept, then the newest
    assert np.isnan(rows["end"][-1]) and not np.isnan(rows["end"][:-1]).any()
    assert flight.open_row()[1] == "RECV_B"
    flight.end(i)
    assert flight.open_row() is None


def _records(tmp_path: Path) -> Path:
    """Three of four ranks' records: ranks 0 and 2 wait on rank 3, which left none."""
    directory, started = tmp_path / "run.flight", time.time()  # one run: rank 0's start, bcast
    for rank, (what, peer) in {0: ("RECV_F", 3), 1: ("grad_wait", -1), 2: ("RECV_B", 3)}.items():
        flight = FlightRecorder(
            rank, pp_rank=rank % 2, dp_rank=rank // 2, world_size=4, run_started=started
        )
        flight.end(flight.begin("F", step=5, stage=rank % 2, microbatch=0))
        flight.begin(what, step=5, stage=rank % 2, microbatch=1, peer=peer, tag=7)
        assert flight.write(directory, "watchdog: no progress") == directory / f"rank{rank}.h5"
    return directory


def test_explain_names_the_rank_the_others_wait_on(tmp_path):
    directory = _records(tmp_path)
    found, records, notes = read_records(tmp_path / "run.h5")  # a trace's name finds RUN.flight/
    assert found == directory and sorted(records) == [0, 1, 2]
    lines = explain(records)
    print("\n".join(lines))
    assert "rank 3: no record" in "\n".join(lines)
    assert lines[-1] == "the job stopped at rank 3: rank(s) 0, 2 waited on it and left no record"
    assert any("in RECV_F stage 0 mb 1 from rank 3 (tag 7), step 5" in line for line in lines)


def test_why_prints_the_verdict_and_refuses_a_run_without_records(tmp_path):
    _records(tmp_path)
    result = CliRunner().invoke(why, [str(tmp_path / "run.h5")])
    assert result.exit_code == 0, result.output
    assert "the job stopped at rank 3" in result.output
    as_json = CliRunner().invoke(why, [str(tmp_path / "run.flight"), "--json"])
    assert as_json.exit_code == 0 and '"rank": 2' in as_json.output
    missing = CliRunner().invoke(why, [str(tmp_path / "other.h5")])
    assert missing.exit_code == 2
    assert missing.output.strip().startswith("mpihybrid: error: no flight records at")
    (tmp_path / "bad.flight").mkdir()
    (tmp_path / "bad.flight" / "rank0.h5").write_bytes(b"not hdf5")
    assert CliRunner().invoke(why, [str(tmp_path / "bad.h5")]).exit_code == 2


def test_why_refuses_crafted_records(tmp_path):
    """A record is read only as the recorder writes it: no FIFO, no data kept outside the file,
    no rank past its world."""
    import h5py

    good = _records(tmp_path) / "rank0.h5"
    fifo = tmp_path / "fifo.flight"
    fifo.mkdir()
    os.mkfifo(fifo / "rank0.h5")  # would block a reader forever
    outside = tmp_path / "outside.flight"
    outside.mkdir()
    (tmp_path / "raw.bin").write_bytes(b"\0" * 4096)
    with h5py.File(good, "r") as src, h5py.File(outside / "rank0.h5", "w") as f:
        f.attrs.update(src.attrs)
        f.create_dataset("rows", shape=(4,), dtype=src["rows"].dtype,
                         external=[(str(tmp_path / "raw.bin"), 0, 4096)])  # fmt: skip
    past = tmp_path / "past.flight"
    past.mkdir()
    with h5py.File(good, "r") as src, h5py.File(past / "rank0.h5", "w") as f:
        f.attrs.update(src.attrs)
        f.attrs["rank"] = 9  # world_size 4
        f.create_dataset("rows", data=src["rows"][()])
    for name in ("fifo", "outside", "past"):
        result = CliRunner().invoke(why, [str(tmp_path / f"{name}.h5")])
        assert result.exit_code == 2, (name, result.output)
        assert "not an mpihybrid flight record" in result.output


def _node_records(directory: Path, waits: dict[int, int], hosts: dict[int, str]) -> None:
    started = time.time()  # one run: every rank has rank 0's start
    for rank, peer in waits.items():
        flight = FlightRecorder(
            rank, pp_rank=rank % 2, dp_rank=rank // 2, world_size=len(hosts), run_started=started
        )
        flight.host = hosts[rank]
        flight.end(flight.begin("F", step=9, stage=rank % 2, microbatch=0))
        flight.begin("RECV_F", step=9, stage=rank % 2, microbatch=1, peer=peer, tag=3)
        flight.write(directory, "watchdog: no progress")


def test_why_reads_a_cut_link_between_two_nodes(tmp_path):
    """Every rank of node a waits on ranks of node b and back: the link, not "rank 2"."""
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    _node_records(tmp_path / "cut.flight", {0: 2, 1: 3, 2: 0, 3: 1}, hosts)
    lines = explain(read_records(tmp_path / "cut.flight")[1])
    assert lines[-1] == (
        "no rank of node b answered ranks of node a: rank(s) 0-1 on a waited on rank(s) 2-3 on b"
        ", and b's ranks on a's: the link between a and b stopped carrying messages"
    )
    # node b's ranks wait on each other (one of them stalled): not a cut link
    _node_records(tmp_path / "one.flight", {0: 2, 1: 3, 2: 3, 3: 2}, hosts)
    lines = explain(read_records(tmp_path / "one.flight")[1])
    assert lines[-1].startswith("no rank of node b answered ranks of node a")
    assert lines[-1].endswith("node b stopped, or the link from it")
    _node_records(tmp_path / "same.flight", {0: 2, 1: 2, 2: 3, 3: 1}, dict.fromkeys(hosts, "a"))
    assert explain(read_records(tmp_path / "same.flight")[1])[-1].startswith(
        "the job stopped at rank 2: rank(s) 0-1 waited on it"
    )


def test_why_leaves_out_an_earlier_runs_records(tmp_path):
    """Records an earlier run left beside the same trace path are not this run's."""
    import h5py

    directory = _records(tmp_path)  # ranks 0-2, just now
    old = FlightRecorder(3, world_size=4, run_started=time.time() - 3600)
    old.begin("RECV_B", step=2, peer=0)
    old.write(directory, "watchdog: an old stall")
    with h5py.File(directory / "rank3.h5", "a") as f:
        f.attrs["written_at"] = time.time() - 3500
    directory, records, notes = read_records(directory)
    assert sorted(records) == [0, 1, 2]
    assert len(notes) == 1 and notes[0].startswith(
        "left out: 1 record(s) of an earlier run (rank 3"
    )
    # a trace whose run started after every record: the records are not its run's
    with h5py.File(tmp_path / "run.h5", "w") as f:
        f.attrs["run_started_at"] = time.time() + 60
    result = CliRunner().invoke(why, [str(tmp_path / "run.h5")])
    assert result.exit_code == 2
    assert result.output.startswith("mpihybrid: error: no flight record of this run (it started at")


def test_why_prints_a_bounded_answer_for_a_crafted_record(tmp_path):
    """A 30 KB record once printed 80 MB (a world of 2**20 ranks, each "no record" one line)."""
    import h5py

    directory = _records(tmp_path)
    with h5py.File(directory / "rank0.h5", "a") as f:
        f.attrs["world_size"] = 1 << 20
        f.attrs["reason"] = "x" * 100_000
        f.attrs["host"] = "h" * 100_000
    result = CliRunner().invoke(why, [str(directory)])
    assert result.exit_code == 0, result.output
    print(result.output)
    assert len(result.output) < 5000
    assert "rank 3-1048575: no record" in result.output
    with h5py.File(directory / "rank1.h5", "a") as f:
        f.attrs["reason"] = np.zeros(1000)  # an array where a string belongs
    assert CliRunner().invoke(why, [str(directory)]).exit_code == 2


def test_record_dir_follows_the_trace_then_the_checkpoints():
    assert record_dir("runs/a.h5", "ck") == Path("runs/a.flight")
    assert record_dir("", "runs/ck/") == Path("runs/ck.flight")  # beside, never inside
    tmp = record_dir("", "", "20261124-0600-42")
    assert tmp.name == "mpihybrid-flight-20261124-0600-42" and tmp.parent.is_dir()


class Ended(Exception):
    pass


def _dog(tmp_path, timeout_s=5.0, **kwargs) -> tuple[Watchdog, FlightRecorder, list]:
    flight = FlightRecorder(rank=1, world_size=2)
    aborted: list[int] = []
    dog = Watchdog(flight, None, timeout_s, aborted.append, lambda: tmp_path / "f", **kwargs)
    dog.say_s = 0.0

    def leave(code):
        raise Ended(code)

    dog.exit = leave
    return dog, flight, aborted


def test_watchdog_ends_a_stalled_rank_naming_its_wait(tmp_path, capsys):
    dog, flight, aborted = _dog(tmp_path, timeout_s=5.0)
    flight.begin("RECV_F", step=3, stage=1, microbatch=2, peer=0, tag=4)
    dog.check(flight.last_activity + 4.0)  # not yet
    assert aborted == []
    with pytest.raises(Ended):
        dog.check(flight.last_activity + 6.0)
    assert aborted == [1]
    line = capsys.readouterr().err.strip()
    assert line.startswith("mpihybrid: error: rank 1: no progress for 6 s (comm.timeout_s = 5)")
    assert "waiting in RECV_F stage 1 mb 2 from rank 0 (tag 4), step 3" in line
    assert (tmp_path / "f" / "rank1.h5").exists()


def test_a_rank_woken_from_a_suspension_does_not_blame_its_wait(tmp_path):
    """Open MPI's mpiexec sends SIGCONT before it ends a job: a rank stopped with SIGSTOP woke,
    found its receive open for longer than the timeout, and named itself as the stall (.ci/run,
    Open MPI leg). A tick far later than asked restarts the stall clock instead."""
    dog, flight, aborted = _dog(tmp_path, timeout_s=5.0, tick_s=1.0)
    flight.begin("RECV_F", step=3, stage=1, microbatch=2, peer=0, tag=4)
    t0 = flight.last_activity
    dog.look(t0 + 1.0)
    for t in (30.0, 31.0, 32.0, 33.0, 34.0):  # asleep for 29 s, then four ticks awake
        dog.look(t0 + t)
    assert aborted == []
    with pytest.raises(Ended):
        dog.look(t0 + 35.5)  # 5.5 s awake and still waiting: a stall
    assert aborted == [1]


def test_a_rank_suspended_before_the_watchdog_first_ticked_does_not_blame_its_wait(tmp_path):
    """A tiny job reaches step 3 0.15 s after the watchdog starts: the test's SIGSTOP came before
    the thread's first tick, so no tick looked late and the woken rank named itself (.ci/run's
    Open MPI leg, twice). The first tick is measured from the start."""
    dog, flight, aborted = _dog(tmp_path, timeout_s=5.0, tick_s=1.0)
    flight.begin("RECV_F", step=3, stage=1, microbatch=2, peer=0, tag=4)
    dog.start()
    try:
        t0 = time.monotonic()
        dog.look(t0 + 29.0)  # asleep for 29 s from the start, before any tick of its own
        assert aborted == []
    finally:
        dog.stop()


def test_watchdog_off_never_fires_and_a_long_wait_is_reported_when_it_ends(tmp_path, caplog):
    dog, flight, aborted = _dog(tmp_path, timeout_s=0.0)
    i = flight.begin("RECV_B", step=2, stage=0, microbatch=0, peer=1, tag=9)
    with caplog.at_level(logging.WARNING, logger="mpihybrid"):
        dog.check(flight.last_activity + 65.0)
        dog.check(flight.last_activity + 66.0)  # said once
        flight.end(i)
        dog.check(flight.last_activity + 0.1)
    assert aborted == []
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "rank 1 has waited 65 s: RECV_B stage 0 mb 0 from rank 1" in messages[0]
    assert "a long wait ended after" in messages[1]


def test_watchdog_signals_grace_and_second_interrupt(tmp_path):
    r, w = os.pipe()
    dog, flight, aborted = _dog(tmp_path, timeout_s=0.0, grace_s=10.0)
    now = time.monotonic()
    os.write(w, bytes([signal.SIGINT, signal.SIGINT]))  # a terminal and mpiexec: one Ctrl-C
    dog._read_signals(r)
    dog.at_boundary()
    dog.check(now + 5)
    assert aborted == []  # within the grace
    with pytest.raises(Ended):
        dog.check(time.monotonic() + 11)  # no boundary for 11 s
    assert aborted == [130]

    dog, flight, aborted = _dog(tmp_path, timeout_s=0.0, grace_s=10.0)
    dog.settle()  # the ranks agreed to stop: a checkpoint may take its time
    os.write(w, bytes([signal.SIGINT]))
    dog._read_signals(r)
    dog.check(time.monotonic() + 60)
    assert aborted == []
    dog.first_interrupt_at -= 2.0  # a second Ctrl-C, two seconds after the first: at once
    os.write(w, bytes([signal.SIGINT]))
    dog._read_signals(r)
    with pytest.raises(Ended):
        dog.check(time.monotonic())
    assert aborted == [130]

    dog, flight, aborted = _dog(tmp_path, timeout_s=0.0, usr1_stops=False)
    os.write(w, bytes([signal.SIGUSR1]))  # nowhere to checkpoint: training goes on
    dog._read_signals(r)
    dog.check(time.monotonic() + 60)
    assert aborted == [] and dog.stop_asked_at is None
    os.close(r)
    os.close(w)


def test_timeout_is_validated():
    assert load_job(None, ["comm.timeout_s=0"], 4).comm.timeout_s == 0
    with pytest.raises(ConfigError, match="comm.timeout_s = -1"):
        load_job(None, ["comm.timeout_s=-1"], 4)
    with pytest.raises(ConfigError, match="comm.timeout_s = 1e-06: below the watchdog's tick"):
        load_job(None, ["comm.timeout_s=1e-6"], 4)  # milliseconds typed as seconds
    assert load_job(None, ["comm.timeout_s=1"], 4).comm.timeout_s == 1


def test_stop_wakes_the_thread_out_of_its_tick(tmp_path):
    """The thread waits on the signals' pipe a tick at a time; stop() wakes it at once (every
    run's end waited up to a tick: about a second a process, minutes over the test suite)."""
    r, w = os.pipe()

    class Signals:  # no signal ever arrives
        wakeup_r = r

    dog = Watchdog(FlightRecorder(rank=0, world_size=1), Signals(), 0.0, [].append,
                   lambda: tmp_path, tick_s=60.0)  # fmt: skip
    dog.start()
    t0 = time.monotonic()
    dog.stop()
    assert time.monotonic() - t0 < 30.0  # not the 60 s tick
    dog.stop()  # twice is harmless
    os.close(r)
    os.close(w)


def test_progress_ticks_the_running_watchdog_only(tmp_path):
    dog, flight, aborted = _dog(tmp_path, timeout_s=5.0)
    progress("searching a schedule")  # no watchdog runs: nothing to tick, no error
    flight.begin("evaluate", step=7)
    dog.start()
    try:
        flight.last_activity -= 100.0  # as if the evaluation had run for 100 s
        progress("evaluation")
        dog.check(time.monotonic())  # would fire without the tick
    finally:
        dog.stop()
    assert aborted == [] and flight.last_progress == "evaluation"
    flight.last_activity -= 100.0
    progress("after the run")  # the watchdog stopped: no longer ticked
    assert flight.last_progress == "evaluation"


def test_a_timeout_below_the_first_step_is_warned_once(tmp_path, caplog):
    dog, flight, aborted = _dog(tmp_path, timeout_s=2.0)
    flight.rank = 0
    dog.at_boundary()  # the start of the steps
    dog.boundary_at -= 3.0  # the first step took 3 s
    with caplog.at_level(logging.WARNING, logger="mpihybrid"):
        dog.at_boundary()
        dog.boundary_at -= 3.0
        dog.at_boundary()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1
    assert said[0].startswith("comm.timeout_s = 2 is below the first step's 3.0 s")


# ---- real runs ----


def _procs_left(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return out.split()


def _start(n: int, *args: str, env: dict | None = None):
    """A long tiny run (a unique seed marks its processes); returns it once a step is done."""
    marker = f"data.seed={uuid.uuid4().int % 10**9}"
    cmd = mpi_command(n, "-m", "mpihybrid", "train", *TINY, "--set", "train.steps=100000",
                      "--set", marker, *args)  # fmt: skip
    proc = subprocess.Popen(cmd, env=mpi_env(env), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    for line in proc.stdout:
        if "step 3/" in line:
            break
    return proc, marker


def _rank_pids(marker: str) -> dict[int, int]:
    pids = {}
    for pid in _procs_left(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:  # MPICH's Hydra says PMI_RANK, Open MPI OMPI_COMM_WORLD_RANK
            name, _, value = item.partition(b"=")
            if name in (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK"):
                pids[int(value)] = int(pid)
    return pids


@pytest.mark.mpi
def test_sigint_to_mpiexec_stops_every_rank_at_a_step_boundary(tmp_path):
    """Once rank 0 left with "Aborted!" and rank 1 spun in the step's Allreduce for minutes."""
    trace = tmp_path / "t.h5"
    proc, marker = _start(2, "--trace", str(trace))
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    if flavour() != "MPICH":
        # Open MPI's mpiexec turns Ctrl-C into SIGTERM to every rank, then kills them after its
        # own short grace: the job still ends on every rank (the bug this holds), exit non-zero,
        # but the agreed step boundary and exit 130 are MPICH's (docs/robustness.md).
        assert proc.returncode != 0, err
        assert _procs_left(marker) == []
        return
    assert proc.returncode == 130, err
    (line,) = [x for x in err.splitlines() if x.startswith("mpihybrid:")]
    assert line.startswith("mpihybrid: interrupted at step") and "no checkpoint" in line, line
    t = load(trace)  # flushed and readable, saying where it stopped
    assert t.attrs["stopped_at_step"] == len(t.steps["loss"]) >= 3
    assert _procs_left(marker) == []


@pytest.mark.mpi
@pytest.mark.parametrize("pp", [2, 1])
def test_an_evaluation_longer_than_the_timeout_is_progress(tmp_path, pp):
    """Once a final evaluation of 3.3 s with comm.timeout_s = 3 was ended as a stall (replica
    0 ran the test set forward in one piece; the next stage and the other replicas waited on it
    without a tick): no report, no trace. Here the evaluation takes over 2 s at a 1 s timeout."""
    trace = tmp_path / "t.h5"
    proc = run_mpi(2, "-m", "mpihybrid", "train", "--set", f"grid.pp={pp}",
                   "--set", "model.hidden=1024", "--set", "data.test_samples=20000",
                   "--set", "train.steps=3", "--set", "comm.timeout_s=1", "--trace", str(trace),
                   timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "no progress" not in proc.stderr and "held-out accuracy" in proc.stdout
    assert load(trace).attrs["finished"]


@pytest.mark.mpi
def test_a_stalled_rank_is_named_by_the_watchdog_and_why(tmp_path):
    trace = tmp_path / "t.h5"
    proc, marker = _start(
        4, "--set", "grid.pp=2", "--set", "comm.timeout_s=3", "--trace", str(trace),
        env={"MPIHYBRID_KERNELS": "numpy"},
    )  # fmt: skip
    os.kill(_rank_pids(marker)[3], signal.SIGSTOP)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    lines = [x for x in err.splitlines() if "no progress for" in x]
    assert lines and all(x.startswith("mpihybrid: error: rank ") for x in lines), err
    assert not any(x.startswith("mpihybrid: error: rank 3:") for x in lines), err
    result = CliRunner().invoke(why, [str(trace)])
    print(result.output)
    assert result.exit_code == 0
    assert "rank 3: no record" in result.output
    assert "the job stopped at rank 3" in result.output
    deadline = time.monotonic() + 10
    while _procs_left(marker) and time.monotonic() < deadline:  # the stopped rank is killed too
        time.sleep(0.2)
    assert _procs_left(marker) == []


@pytest.mark.mpi
@pytest.mark.parametrize(
    "mode, code, said",
    [
        ("int-one", 130, "mpihybrid: interrupted at step 1 "),  # SIGINT to one rank only
        ("exit-one", 1, "mpihybrid: error: training failed on rank 1, step 1: SystemExit"),
    ],
)
def test_one_rank_interrupted_or_leaving_ends_the_whole_job(tmp_path, mode, code, said):
    proc = run_mpi(
        2,
        "tests/_mpi_inject.py",
        mode,
        "train",
        "--quiet",
        *TINY,
        "--set",
        "train.steps=6",
        timeout=60,
        env={"TMPDIR": str(tmp_path)},
    )  # fmt: skip  (an exit's record: not in /tmp)
    assert proc.returncode == code, proc.stderr
    assert said in proc.stderr, proc.stderr


@pytest.mark.mpi
def test_signals_after_the_last_step_finish_the_run_with_a_final_checkpoint(tmp_path):
    """Once SIGUSR1 in the held-out evaluation killed every rank: no report, no final flush."""
    ckpt, trace = tmp_path / "ck", tmp_path / "t.h5"
    proc = run_mpi(2, "tests/_mpi_inject.py", "usr1-end", "train", "--quiet", *TINY,
                   "--set", "train.steps=5", "--set", f"checkpoint.dir={ckpt}",
                   "--set", "checkpoint.every=2", "--trace", str(trace), timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "a stop signal came after the last step: the run finishes" in proc.stdout
    assert checkpoint.read_manifest(checkpoint.latest(ckpt))["step"] == 5
    t = load(trace)
    assert t.attrs["finished"] and len(t.steps["loss"]) == 5
    assert "held-out accuracy" in proc.stdout  # the report is printed


@pytest.mark.mpi
def test_signals_while_a_checkpoint_is_written_are_absorbed(tmp_path):
    """Once a second SIGUSR1/SIGTERM during the checkpoint gave exit 15 or 10 instead of 3."""
    ckpt = tmp_path / "ck"
    proc = run_mpi(2, "tests/_mpi_inject.py", "usr1-ckpt", "train", "--quiet", *TINY,
                   "--set", "train.steps=6", "--set", f"checkpoint.dir={ckpt}",
                   "--set", "checkpoint.every=2", timeout=60)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "preempted at step 3: checkpoint written to" in proc.stdout
    assert checkpoint.read_manifest(checkpoint.latest(ckpt))["step"] == 3


@pytest.mark.mpi
def test_a_signal_while_the_model_is_built_stops_before_any_step(tmp_path):
    ckpt = tmp_path / "ck"
    proc = run_mpi(2, "tests/_mpi_inject.py", "usr1-build", "train", "--quiet", *TINY,
                   "--set", "train.steps=6", "--set", f"checkpoint.dir={ckpt}")  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "preempted before step 1: no step had run, nothing new to write" in proc.stdout
    assert checkpoint.complete(ckpt) == []


@pytest.mark.mpi
def test_a_ring_over_shared_memory_finalizes_under_the_ofi_netmod():
    """MPICH over OFI (what crosses nodes on a cluster) failed MPI_Finalize ("fabricclose ...
    busy", exit 15) after a lossy ring's shared windows were left to it."""
    if flavour() != "MPICH":
        pytest.skip(f"MPICH's OFI netmod is what this holds; the tests run {flavour()}")
    ofi = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "MPIHYBRID_KERNELS": "numpy"}
    probe = run_mpi(2, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()", env=ofi)
    if probe.returncode != 0:
        pytest.skip(f"this MPI has no OFI tcp netmod here: {probe.stderr.strip()[-200:]}")
    sharded = ["--set", "train.shard_optimizer=true", "--set", "comm.param_codec=bf16"]
    for extra in ([], sharded):  # the gradient rings, then the weight gathers' too
        args = ["--set", "train.steps=2", "--set", "grid.pp=1", "--set", "comm.codec=int8"]
        proc = run_mpi(2, "-m", "mpihybrid", "train", "--quiet", *TINY, *args, *extra, env=ofi)
        assert proc.returncode == 0, (extra, proc.stderr[-2000:])


# ---- the memory a job really has: its cgroup (SLURM --mem), its RLIMIT_AS ----


def _fake_cgroup(tmp_path: Path, version: int, limits: dict[str, tuple[str, str]]) -> tuple:
    """A cgroup tree: {relative dir: (limit, usage)}; the process sits in job/step."""
    root = tmp_path / "cg"
    mount = root if version == 2 else root / "memory"
    names = ("memory.max", "memory.current") if version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes")  # fmt: skip
    for rel, (limit, usage) in limits.items():
        d = mount / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / names[0]).write_text(limit + "\n")
        (d / names[1]).write_text(usage + "\n")
    if version == 2:
        (root / "cgroup.controllers").write_text("cpu memory\n")
    line = "0::/job/step" if version == 2 else "4:memory:/job/step\n0::/"
    (tmp_path / "self").write_text(line + "\n")
    return str(root), str(tmp_path / "self")


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_headroom_is_the_tightest_limit_up_the_tree(tmp_path, version):
    gib = 1 << 30
    none = "max" if version == 2 else str(9223372036854771712)
    root, me = _fake_cgroup(tmp_path, version, {
        "": (none, str(50 * gib)),
        "job": (str(4 * gib), str(gib)),  # SLURM's job cgroup: --mem=4G, 1 GiB in use
        "job/step": (none, str(gib)),
    })  # fmt: skip
    room, words = memory.cgroup_headroom(root, me)
    assert room == 3 * gib
    assert "4.00 GiB" in words and "job" in words
    root, me = _fake_cgroup(tmp_path / "free", version, {"": (none, "0"), "job/step": (none, "1")})
    assert memory.cgroup_headroom(root, me) is None
    assert memory.cgroup_headroom(root, str(tmp_path / "missing")) is None


@pytest.mark.mpi
def test_check_fits_reads_the_cgroup_limit():
    """A 1-rank check against a 100 MiB cgroup while MemAvailable says plenty."""
    code = (
        "from mpi4py import MPI\n"
        "from mpihybrid.config import ConfigError, load_job\n"
        "from mpihybrid.train.memory import check_fits\n"
        "job = load_job(None, ['model.hidden=2048'], 1)\n"
        "check_fits(job, MPI.COMM_WORLD, available=1 << 40, cgroup=(100 << 20, 'the limit'))\n"
    )
    proc = run_mpi(1, "-c", code)
    assert proc.returncode != 0
    assert "but the limit leaves 100.00 MiB" in proc.stderr, proc.stderr[-500:]


CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def _own_memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            here = CGROUP_V1 / rel.lstrip("/")
            return here if here.is_dir() else CGROUP_V1
    return None


@pytest.mark.mpi
def test_a_job_under_a_cgroup_memory_limit_is_refused_with_the_limit(tmp_path):
    """What SLURM's --mem sets: once the check compared with MemAvailable alone and passed, and
    the kernel then killed a rank with no word about memory."""
    parent = _own_memory_cgroup() if CGROUP_V1.is_dir() else None
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("needs a writable cgroup v1 memory hierarchy (root in a container here)")
    group = parent / f"mpihybrid-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup: {exc}")
    try:
        (group / "memory.limit_in_bytes").write_text(str(600 << 20))
        cmd = mpi_command(2, "-m", "mpihybrid", "train", "--set", "model.hidden=4096",
                          "--set", "train.steps=1")  # fmt: skip
        shell = f'echo $$ > {group}/cgroup.procs && exec "$@"'
        proc = subprocess.run(["sh", "-c", shell, "sh", *cmd], capture_output=True, text=True,
                              env=mpi_env(), cwd=ROOT, timeout=120)  # fmt: skip
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert proc.returncode == 2, proc.stderr[-1000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("mpihybrid: error:")]
    assert "the memory cgroup's limit" in line and "600.00 MiB" in line, line
