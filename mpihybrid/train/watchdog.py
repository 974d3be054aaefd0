"""Nothing waits forever: the stop signals, the watchdog thread and every rank's flight record.

    signals = StopSignals.install()        # first thing in `mpihybrid train`, before MPI's init
    flight = FlightRecorder(world.rank, ...)
    i = flight.begin("RECV_F", step, stage, mb, peer, tag); ...; flight.end(i)   # per action
    dog = Watchdog(flight, signals, timeout_s=600, abort=world.Abort, ...).start()
    ...
    dog.stop()

Signals only set flags (a Python handler runs on the main thread between two bytecodes, never
inside an MPI call), and the loop acts on them at a step boundary that every rank agrees on:
SIGUSR1/SIGTERM (a preemption: checkpoint, exit 3) and SIGINT (an interrupt: exit 130). The
watchdog is a thread that sees the same signals through signal.set_wakeup_fd, so it can act while
the main thread is blocked inside MPI: a rank that does not reach the agreed boundary within the
grace period, a second interrupt, or a rank that makes no progress for `timeout_s` ends the job
with MPI_Abort, after one line saying what this rank waits on and its flight record on disk.

The flight record is a fixed ring of this rank's last actions and waits (begin, end, peer, tag,
bytes): two list stores per action on the hot path. `mpihybrid why RUN` reads the records back.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger("mpihybrid")

PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
INTERRUPT = signal.SIGINT
EXIT_INTERRUPTED = 130  # what a shell reports for a job ended by Ctrl-C (128 + SIGINT)
FLIGHT_ROWS = 512  # actions and waits kept per rank
RECORD_ATTRS = ("format", "rank", "pp_rank", "dp_rank", "world_size", "reason", "written_at",
                "host", "pid")  # fmt: skip
MAX_WORLD = 1 << 20
RECORD_DTYPE = np.dtype(
    [
        ("start", "<f8"),  # wall-clock seconds (time.time() scale)
        ("end", "<f8"),  # NaN: still running (what the rank was waiting on)
        ("step", "<i4"),  # 1-based, as the progress line counts; 0 outside the steps
        ("what", "S24"),  # F, B, W, SEND_F, RECV_B, ... or a phase (allreduce, checkpoint, ...)
        ("stage", "<i4"),
        ("microbatch", "<i4"),
        ("peer", "<i4"),  # world rank of the other side, -1 none
        ("tag", "<i4"),  # MPI tag of a message, -1 none
        ("nbytes", "<i8"),
    ]
)


class StopSignals:
    """Every stop signal of the process, from `install()` until it exits: flags, never exits.

    `usr1`, `term` and `interrupts` count SIGUSR1, SIGTERM and SIGINT as the main thread's
    handler saw them; `first_at` is when the first came (time.monotonic()). The watchdog thread
    reads the same signals from the wakeup pipe the moment they come, even while the main thread
    is blocked inside MPI and its handler cannot run."""

    _installed: StopSignals | None = None

    def __init__(self) -> None:
        self.usr1 = self.term = self.interrupts = 0
        self.first_at: float | None = None
        self.wakeup_r = -1

    @classmethod
    def install(cls) -> StopSignals:
        """Install the handlers once per process (main thread only); later calls return them."""
        if cls._installed is not None:
            return cls._installed
        self = cls()
        for sig in (*PREEMPT_SIGNALS, INTERRUPT):
            signal.signal(sig, self._handle)
        r, w = os.pipe()
        os.set_blocking(w, False)
        os.set_blocking(r, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self.wakeup_r = r
        cls._installed = self
        return self

    def _handle(self, signum, frame) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
        if signum == INTERRUPT:
            self.interrupts += 1
        elif signum == signal.SIGTERM:
            self.term += 1
        else:
            self.usr1 += 1

    def reset(self) -> None:
        """Forget the signals handled (a sweep trains many times in one process)."""
        self.usr1 = self.term = self.interrupts = 0
        self.first_at = None

    @property
    def any(self) -> bool:
        return bool(self.usr1 or self.term or self.interrupts)


class FlightRecorder:
    """This rank's last FLIGHT_ROWS actions and waits, a fixed ring of tuples."""

    def __init__(self, rank: int, pp_rank: int = -1, dp_rank: int = -1, world_size: int = 0):
        self.rank, self.pp_rank, self.dp_rank, self.world_size = rank, pp_rank, dp_rank, world_size
        self.rows: list = [None] * FLIGHT_ROWS
        self.ends: list = [np.nan] * FLIGHT_ROWS
        self.count = 0  # rows ever begun
        self.last_activity = time.monotonic()

    def begin(self, what: str, step: int = 0, stage: int = -1, microbatch: int = -1,
              peer: int = -1, tag: int = -1, nbytes: int = 0) -> int:  # fmt: skip
        i = self.count % FLIGHT_ROWS
        self.rows[i] = (time.time(), what, step, stage, microbatch, peer, tag, nbytes)
        self.ends[i] = np.nan
        self.count += 1
        self.last_activity = time.monotonic()
        return i

    def end(self, i: int) -> None:
        self.ends[i] = time.time()
        self.last_activity = time.monotonic()

    def open_row(self) -> tuple | None:
        """The newest row still running (what the rank is doing or waiting on), else None."""
        for back in range(1, min(self.count, FLIGHT_ROWS) + 1):
            i = (self.count - back) % FLIGHT_ROWS
            if self.ends[i] != self.ends[i]:  # NaN
                return self.rows[i]
        return None

    def to_array(self) -> np.ndarray:
        """The kept rows, oldest first."""
        n = min(self.count, FLIGHT_ROWS)
        out = np.zeros(n, RECORD_DTYPE)
        for j in range(n):
            i = (self.count - n + j) % FLIGHT_ROWS
            start, what, step, stage, mb, peer, tag, nbytes = self.rows[i]
            out[j] = (start, self.ends[i], step, what.encode()[:24], stage, mb, peer, tag, nbytes)
        return out

    def write(self, directory: str | Path, reason: str) -> Path | None:
        """This rank's record as DIRECTORY/rank{R}.h5 (temporary, then rename); None when the
        file system refuses (the one line already said what happened)."""
        import h5py

        directory = Path(directory)
        path = directory / f"rank{self.rank}.h5"
        tmp = directory / f".rank{self.rank}.h5.{os.getpid()}.tmp"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with h5py.File(tmp, "w") as f:
                f.create_dataset("rows", data=self.to_array())
                f.attrs.update(
                    format="mpihybrid-flight-1", rank=self.rank, pp_rank=self.pp_rank,
                    dp_rank=self.dp_rank, world_size=self.world_size, reason=reason,
                    written_at=time.time(), host=socket.gethostname(), pid=os.getpid(),
                )  # fmt: skip
            os.replace(tmp, path)
            return path
        except OSError as exc:
            sys.stderr.write(f"mpihybrid: rank {self.rank}: flight record not written: {exc}\n")
            tmp.unlink(missing_ok=True)
            return None


def describe(row: tuple | np.void, now: float | None = None) -> str:
    """One row as words: `RECV_F stage 1 mb 2 from rank 0 (tag 5), step 3, for 12.0 s`."""
    if isinstance(row, np.void):
        start, what = float(row["start"]), row["what"].decode()
        step, stage, mb = int(row["step"]), int(row["stage"]), int(row["microbatch"])
        peer, tag = int(row["peer"]), int(row["tag"])
    else:
        start, what, step, stage, mb, peer, tag, _ = row
    text = what
    if stage >= 0:
        text += f" stage {stage}"
    if mb >= 0:
        text += f" mb {mb}"
    if peer >= 0:
        text += (" from" if what.startswith("RECV") else " with") + f" rank {peer}"
    if tag >= 0:
        text += f" (tag {tag})"
    if step > 0:
        text += f", step {step}"
    if now is not None:
        text += f", for {now - start:.1f} s"
    return text


class Watchdog:
    """A daemon thread per rank: stop signals the main thread cannot reach, and stalls.

    abort(code) ends the whole job (MPI_Abort); record_dir() is where the flight record goes."""

    def __init__(
        self,
        flight: FlightRecorder,
        signals: StopSignals | None,
        timeout_s: float,
        abort: Callable[[int], None],
        record_dir: Callable[[], str | Path],
        usr1_stops: bool = True,
        grace_s: float = 10.0,
        tick_s: float = 1.0,
    ):
        """usr1_stops: SIGUSR1 asks for a stop (a checkpoint can be written); else it is only
        noted and training goes on."""
        self.flight, self.signals = flight, signals
        self.timeout_s, self.grace_s, self.tick_s = timeout_s, grace_s, tick_s
        self.warn_s = min(60.0, timeout_s / 2) if timeout_s > 0 else 60.0
        self.abort, self.record_dir = abort, record_dir
        self.exit, self.say_s = os._exit, 2.0  # tests replace them
        self.boundary_at = time.monotonic()  # the last step boundary this rank reached
        self.slowest_step = 0.0
        self.settled = False  # the ranks agreed to stop, or training is over: no grace applies
        self.usr1_stops = usr1_stops
        self.stop_asked_at: float | None = None  # the first signal that asks for a stop
        self.first_interrupt_at: float | None = None
        self.forced = False  # a second interrupt, over a second after the first
        self._stop = threading.Event()
        self._warned: tuple | None = None  # the open row a "waited long" warning named
        self._thread = threading.Thread(target=self._loop, name="mpihybrid-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at_boundary(self) -> None:
        """The main thread reached a step boundary (the signals' grace restarts from here)."""
        now = time.monotonic()
        self.slowest_step = max(self.slowest_step, now - self.boundary_at)
        self.boundary_at = now

    def settle(self) -> None:
        """Every rank agreed how the run ends (a stop, or the steps are done): a signal from now
        on is absorbed, and only a stall or a second interrupt ends the job."""
        self.settled = True

    def grace(self) -> float:
        """How long an agreed stop may take to reach the next boundary: a few seconds, or three
        of the slowest steps so far when steps are long."""
        return max(self.grace_s, 3 * self.slowest_step)

    def _loop(self) -> None:
        fd = self.signals.wakeup_r if self.signals is not None else -1
        while not self._stop.is_set():
            if fd >= 0:
                ready, _, _ = select.select([fd], [], [], self.tick_s)
                if ready:
                    self._read_signals(fd)
            elif self._stop.wait(self.tick_s):
                break
            if not self._stop.is_set():
                self.check(time.monotonic())

    def _read_signals(self, fd: int) -> None:
        try:
            data = os.read(fd, 64)
        except BlockingIOError:
            return
        now = time.monotonic()
        for signum in data:
            if signum == INTERRUPT:
                # a terminal's Ctrl-C reaches a rank twice at once (from it and from mpiexec)
                if self.first_interrupt_at is None:
                    self.first_interrupt_at = now
                elif now - self.first_interrupt_at > 1.0:
                    self.forced = True
            elif signum == signal.SIGUSR1 and not self.usr1_stops:
                continue
            if self.stop_asked_at is None:
                self.stop_asked_at = now

    def check(self, now: float) -> None:
        """One look: a forced stop, an agreed stop that does not come, a stall, a long wait."""
        if self.forced:
            self.fire(f"second interrupt: stopping at once ({self._waiting(now)})", 130)
        asked = self.stop_asked_at
        if asked is not None and not self.settled:
            late = now - max(asked, self.boundary_at)
            if late > self.grace():
                what = "interrupt" if self.first_interrupt_at is not None else "stop signal"
                self.fire(
                    f"{what}: the ranks did not reach the next step boundary within "
                    f"{self.grace():.0f} s ({self._waiting(now)})",
                    130 if self.first_interrupt_at is not None else 1,
                )
        idle = now - self.flight.last_activity
        row = self.flight.open_row()
        if self.timeout_s > 0 and idle > self.timeout_s:
            self.fire(
                f"no progress for {idle:.0f} s (comm.timeout_s = {self.timeout_s:g}): "
                f"{self._waiting(now)}",
                1,
            )
        if row is not None and idle > self.warn_s and self._warned is not row:
            self._warned = row
            log.warning("rank %d has waited %.0f s: %s", self.flight.rank, idle,
                        describe(row))  # fmt: skip
        elif self._warned is not None and row is not self._warned:
            start = self._warned[0]
            log.warning("rank %d: a long wait ended after %.1f s: %s", self.flight.rank,
                        time.time() - start, describe(self._warned))  # fmt: skip
            self._warned = None

    def _waiting(self, now: float) -> str:
        row = self.flight.open_row()
        if row is None:
            return "between actions"
        return "waiting in " + describe(row, time.time())

    def fire(self, why: str, code: int) -> None:
        """Say it in one line, keep the flight record, let the other ranks' watchdogs say theirs
        (they stalled at about the same moment), then end the job."""
        rank = self.flight.rank
        path = self.flight.write(self.record_dir(), f"watchdog: {why}")
        where = f" (flight record: {path})" if path else ""
        sys.stderr.write(f"mpihybrid: error: rank {rank}: {why}{where}\n")
        sys.stderr.flush()
        self._stop.wait(self.say_s)
        try:
            self.abort(code)
        except Exception:  # the job must end all the same
            pass
        self.exit(code)  # MPI_Abort returns under some MPIs (the PyPI MPICH)


def record_dir(trace_path: str, checkpoint_dir: str, run_id: str = "") -> Path:
    """Where a run's flight records go: beside its trace (RUN.h5 -> RUN.flight/), else beside its
    checkpoint directory (DIR -> DIR.flight/: never inside it, where only checkpoints live), else
    a directory of the run's own in the temporary directory (the watchdog's line names it)."""
    if trace_path:
        p = Path(trace_path)
        return p.with_name(p.stem + ".flight")
    if checkpoint_dir:
        p = Path(checkpoint_dir)
        return p.with_name(p.name + ".flight")
    return Path(tempfile.gettempdir()) / f"mpihybrid-flight-{run_id or os.getpid()}"


def run_id() -> str:
    """A name for this run's records when it has no trace or checkpoint directory: the start
    time and rank 0's process id (rank 0 broadcasts it, so every rank writes to one place)."""
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


def read_records(path: str | Path) -> tuple[Path, dict[int, tuple[dict, np.ndarray]]]:
    """Every rank's flight record for a trace (RUN.h5) or a record directory: rank -> (attrs,
    rows). ValueError with one line when there is none or a file is not one."""

    path = Path(path)
    directory = path if path.is_dir() else path.with_name(path.stem + ".flight")
    if not directory.is_dir():
        raise ValueError(f"no flight records at {directory} (written when a run ends abnormally)")
    records = {}
    for file in sorted(directory.glob("rank*.h5")):
        records.update([_read_record(file)])
    if not records:
        raise ValueError(f"no flight records in {directory}")
    return directory, records


def _read_record(file: Path) -> tuple[int, tuple[dict, np.ndarray]]:
    """One rank's record, read only when it is one this recorder could have written: a regular
    HDF5 file, its rows a plain dataset kept in the file, at most FLIGHT_ROWS of them."""
    import h5py

    from mpihybrid.files import h5_dataset_problem

    if not file.is_file() or file.is_symlink() or not h5py.is_hdf5(file):
        raise ValueError(f"{file}: not an mpihybrid flight record")
    try:
        with h5py.File(file, "r") as f:
            link = f.get("rows", getlink=True)
            rows = f.get("rows") if isinstance(link, h5py.HardLink) else None
            if (
                f.attrs.get("format") != "mpihybrid-flight-1"
                or not isinstance(rows, h5py.Dataset)
                or rows.dtype != RECORD_DTYPE
                or rows.ndim != 1
                or rows.shape[0] > FLIGHT_ROWS
                or h5_dataset_problem(rows, file.stat().st_size)
            ):
                raise ValueError(f"{file}: not an mpihybrid flight record")
            attrs = {k: f.attrs[k] for k in RECORD_ATTRS if k in f.attrs}
            world, rank = int(attrs.get("world_size", -1)), int(attrs.get("rank", -1))
            if len(attrs) != len(RECORD_ATTRS) or not 0 <= rank < world <= MAX_WORLD:
                raise ValueError(f"{file}: not an mpihybrid flight record")
            return rank, (attrs, rows[()])
    except (OSError, KeyError, TypeError) as exc:
        raise ValueError(f"{file}: unreadable ({exc})") from None


def explain(records: dict[int, tuple[dict, np.ndarray]]) -> list[str]:
    """What each rank was doing when the job ended, and which rank the others waited on."""
    world = max(int(a.get("world_size", 0)) for a, _ in records.values())
    world = max(world, max(records) + 1)
    written = max(float(a["written_at"]) for a, _ in records.values())
    lines, waited_on = [], {}
    for rank in range(world):
        if rank not in records:
            lines.append(f"rank {rank}: no record (stopped or killed before it could write one)")
            continue
        attrs, rows = records[rank]
        head = f"rank {rank} (pp {attrs['pp_rank']}, dp {attrs['dp_rank']}, {attrs['host']})"
        running = rows[np.isnan(rows["end"])]
        done = rows[~np.isnan(rows["end"])]
        last = f"; last done: {describe(done[-1])}" if len(done) else ""
        if len(running):
            row = running[-1]
            lines.append(f"{head}: in {describe(row, float(attrs['written_at']))}{last}")
            if int(row["peer"]) >= 0:
                waited_on.setdefault(int(row["peer"]), []).append(rank)
        else:
            lines.append(f"{head}: between actions{last}")
        lines.append(f"    ended by: {attrs['reason']}")
    missing = [r for r in range(world) if r not in records]
    if waited_on:
        culprit = max(waited_on, key=lambda r: (r not in records, len(waited_on[r])))
        who = ", ".join(map(str, waited_on[culprit]))
        tail = " and left no record" if culprit not in records else ""
        lines.append(f"the job stopped at rank {culprit}: rank(s) {who} waited on it{tail}")
    elif missing and len(missing) < world:
        who = ", ".join(map(str, missing))
        lines.append(
            f"the job stopped at rank {who}: the others waited for it in collectives and it left "
            "no record"
        )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written))
    lines.insert(0, f"flight records of {len(records)} of {world} ranks, the last at {stamp}")
    return lines
