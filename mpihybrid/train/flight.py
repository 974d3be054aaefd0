"""Every rank's flight record: its last actions and waits, kept in a fixed ring and written
when a run ends abnormally; `mpihybrid why RUN` reads them back.

    flight = FlightRecorder(world.rank, world_size=world.Get_size())
    i = flight.begin("RECV_F", step, stage, mb, peer, tag); ...; flight.end(i)   # per action
    flight.write(record_dir(trace_path, checkpoint_dir), "watchdog: ...")
    (reading them back, `mpihybrid why`: train.explain)

Two list stores per action on the hot path; the file format is in docs/robustness.md.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpihybrid.sysinfo import hostname

FLIGHT_ROWS = 512  # actions and waits kept per rank
RECORD_ATTRS = (
    "format",
    "rank",
    "pp_rank",
    "dp_rank",
    "world_size",
    "reason",
    "written_at",
    "host",
    "pid",
)
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


class FlightRecorder:
    """This rank's last FLIGHT_ROWS actions and waits, a fixed ring of tuples."""

    def __init__(
        self,
        rank: int,
        pp_rank: int = -1,
        dp_rank: int = -1,
        world_size: int = 0,
        run_started: float = 0.0,
    ):
        """run_started: rank 0's clock when the run began, the same on every rank (what tells
        this run's records from an earlier run's in the same directory)."""
        self.rank, self.pp_rank, self.dp_rank, self.world_size = rank, pp_rank, dp_rank, world_size
        self.run_started = run_started or time.time()
        self.host = hostname()
        self.rows: list = [None] * FLIGHT_ROWS
        self.ends: list = [np.nan] * FLIGHT_ROWS
        self.count = 0  # rows ever begun
        self.last_activity = time.monotonic()
        self.last_progress = ""  # what the last progress tick said (mpihybrid.progress)

    def begin(
        self,
        what: str,
        step: int = 0,
        stage: int = -1,
        microbatch: int = -1,
        peer: int = -1,
        tag: int = -1,
        nbytes: int = 0,
    ) -> int:
        i = self.count % FLIGHT_ROWS
        self.rows[i] = (time.time(), what, step, stage, microbatch, peer, tag, nbytes)
        self.ends[i] = np.nan
        self.count += 1
        self.last_activity = time.monotonic()
        return i

    def end(self, i: int) -> None:
        self.ends[i] = time.time()
        self.last_activity = time.monotonic()

    def tick(self, what: str = "") -> None:
        """Work goes on inside the open row (mpihybrid.progress): not a stall."""
        self.last_progress = what
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
                    format="mpihybrid-flight-1",
                    rank=self.rank,
                    pp_rank=self.pp_rank,
                    dp_rank=self.dp_rank,
                    world_size=self.world_size,
                    reason=reason,
                    written_at=time.time(),
                    host=self.host,
                    pid=os.getpid(),
                    run_started=self.run_started,
                )
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
