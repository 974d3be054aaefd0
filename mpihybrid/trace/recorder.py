"""Trace events: every rank records what it did and when; rank 0 gathers them (trace.file
writes them to HDF5).

    rec = Recorder(rank, replica=grid.dp_rank)
    offset = clock_offset(comm)                      # once, before training
    t0 = rec.clock(); forward(...); rec.record(KIND["forward"], step, stage, mb, t0, rec.clock())
    events = gather_events(comm, rec, offset)        # collective; rows on rank 0, None elsewhere

The row layout (EVENT_DTYPE) is documented in docs/trace-format.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger(__name__)

# grad_wait: the main thread waiting, after the pipeline, for the gradient buckets still being
# reduced (the exposed part of the all-reduce); allreduce and optimizer rows are per bucket
KINDS = (
    "forward",
    "backward",
    "weight",
    "send",
    "recv",
    "allreduce",
    "optimizer",
    "step",
    "grad_wait",
    # model.vocab_parallel: a rank's passes on its share of the vocabulary (E, S, T, G)
    "vocab_embed",
    "vocab_logits",
    "vocab_grad",
    "vocab_embed_grad",
)
KIND = {name: code for code, name in enumerate(KINDS)}
EVENT_DTYPE = np.dtype(
    [
        ("rank", "<i4"),
        ("stage", "<i4"),
        ("replica", "<i4"),
        ("kind", "u1"),
        ("step", "<i4"),
        ("microbatch", "<i4"),
        ("start", "<f8"),
        ("end", "<f8"),
        ("bytes", "<i8"),
        ("peer", "<i4"),
        ("cpu", "<f8"),
    ]
)
# the columns of schema version 2 and before (no cpu): a reader fills cpu with NaN
EVENT_DTYPE_V2 = np.dtype([(n, EVENT_DTYPE[n]) for n in EVENT_DTYPE.names if n != "cpu"])
# the compute kinds as the schedule letters F, B, W (what a trace row ran, as an Action kind)
COMPUTE = {KIND["forward"]: "F", KIND["backward"]: "B", KIND["weight"]: "W"}
# model.vocab_parallel's passes: a rank's compute too (its busy time, the bubble)
VOCAB_PASSES = ("vocab_embed", "vocab_logits", "vocab_grad", "vocab_embed_grad")
# ... as their schedule letters (pipeline/vocab_passes.py); a row's share is its rank's pp rank
VOCAB = {KIND[k]: letter for k, letter in zip(VOCAB_PASSES, "ESTG", strict=True)}
_STEP = KIND["step"]
_CLOCK_TAG = 32767  # the largest tag MPI guarantees; used only before any other traffic


@dataclass(frozen=True)
class StepWindow:
    """Which steps are traced: every `every`-th step from `first` to `last` (1-based, as the
    progress line counts them; last = 0: to the end). Step numbers given to keeps() are the
    0-based ones the loop and the trace rows use."""

    first: int = 1
    last: int = 0
    every: int = 1

    def keeps(self, step: int) -> bool:
        n = step + 1
        return (
            n >= self.first
            and (self.last == 0 or n <= self.last)
            and ((n - self.first) % self.every == 0)
        )


class Recorder:
    """One rank's events of the steps its window keeps, appended into a structured array that
    grows as needed; clear() empties it after a flush, so it holds only the rows since then."""

    clock = staticmethod(time.perf_counter)  # the clock every start/end is read from

    def __init__(
        self, rank: int, replica: int, capacity: int = 4096, window: StepWindow | None = None
    ) -> None:
        self.rank = rank
        self.replica = replica
        self._rows = np.zeros(max(1, capacity), dtype=EVENT_DTYPE)
        self._n = 0
        self.window = window or StepWindow()
        self._step, self._keep = None, True  # the step last seen and whether it is traced
        self.last_step_time = float("nan")  # seconds of the last "step" row, traced or not

    def record(
        self,
        kind: int,
        step: int,
        stage: int,
        microbatch: int,
        start: float,
        end: float,
        nbytes: int = 0,
        peer: int = -1,
        cpu: float = float("nan"),
    ) -> None:
        # hot path: one tuple store; the check stops an unknown code wrapping silently in u1
        if not 0 <= kind < len(KINDS):
            raise ValueError(f"unknown event kind code {kind}; kinds are {KINDS}")
        if kind == _STEP:
            self.last_step_time = end - start
        if step != self._step:
            self._step, self._keep = step, self.window.keeps(step)
        if not self._keep:
            return
        if self._n == len(self._rows):
            self._grow()
        self._rows[self._n] = (
            self.rank,
            stage,
            self.replica,
            kind,
            step,
            microbatch,
            start,
            end,
            nbytes,
            peer,
            cpu,
        )
        self._n += 1

    def _grow(self) -> None:
        rows = np.zeros(2 * len(self._rows), dtype=EVENT_DTYPE)
        rows[: self._n] = self._rows[: self._n]
        self._rows = rows

    @property
    def events(self) -> np.ndarray:
        """The filled rows (a view: copy before keeping it past the next record)."""
        return self._rows[: self._n]

    def clear(self) -> None:
        """Forget the rows (after they were flushed); the buffer is kept for the next ones."""
        self._n = 0

    def drop_before(self, step: int) -> None:
        """Forget the rows of steps before `step` (0-based): a run that writes no trace file
        keeps its last steps' rows only, not every step's."""
        kept = self._rows[: self._n][self._rows[: self._n]["step"] >= step]
        self._rows[: len(kept)] = kept
        self._n = len(kept)

    @property
    def capacity(self) -> int:
        return len(self._rows)

    def __len__(self) -> int:
        return self._n


class StepRecorder(Recorder):
    """Keeps only the per-step rows: what a run costs without per-action tracing."""

    def record(self, kind: int, step: int, *args, **kwargs) -> None:
        if kind == KIND["step"]:
            super().record(kind, step, *args, **kwargs)


def step_times(events: np.ndarray) -> dict[int, float]:
    """Seconds per step: the first start to the last end of the "step" rows given (every rank's,
    or one rank's for that rank's own time), in step order. The one definition of a step time."""
    rows = events[events["kind"] == KIND["step"]]
    steps, step_of = np.unique(rows["step"], return_inverse=True)  # one sort, no mask per step
    first, last = np.full(len(steps), np.inf), np.full(len(steps), -np.inf)
    np.minimum.at(first, step_of, rows["start"])
    np.maximum.at(last, step_of, rows["end"])
    return {int(s): float(b - a) for s, a, b in zip(steps, first, last, strict=True)}


# ---------------------------------------------------------------------------------------------
# clocks and gathering (collective over comm)


def clock_offset(comm: MPI.Comm, rounds: int = 16) -> float:
    """Seconds to add to this rank's clock to read rank 0's clock; 0.0 on rank 0.

    Each rank ping-pongs with rank 0 `rounds` times; rank 0 answers with its clock. Assuming the
    reply was read halfway through the round trip, offset = t_rank0 - (t_send + t_recv) / 2; the
    round with the shortest trip is kept, so the error is at most half of that trip.
    """
    from mpi4py import MPI

    clock = Recorder.clock
    buf = np.zeros(1, dtype=np.float64)
    if comm.rank == 0:
        # serve one rank at a time so each round trip measures only the two ranks involved
        for peer in range(1, comm.size):
            for _ in range(rounds):
                comm.Recv([buf, MPI.DOUBLE], source=peer, tag=_CLOCK_TAG)
                buf[0] = clock()
                comm.Send([buf, MPI.DOUBLE], dest=peer, tag=_CLOCK_TAG)
        return 0.0
    best_trip, best_offset = float("inf"), 0.0
    for _ in range(rounds):
        t_send = clock()
        comm.Send([buf, MPI.DOUBLE], dest=0, tag=_CLOCK_TAG)
        comm.Recv([buf, MPI.DOUBLE], source=0, tag=_CLOCK_TAG)
        t_recv = clock()
        if t_recv - t_send < best_trip:
            best_trip = t_recv - t_send
            best_offset = float(buf[0]) - (t_send + t_recv) / 2
    log.debug("clock offset %+.6f s (round trip %.1f us)", best_offset, best_trip * 1e6)
    return best_offset


def gather_events(comm: MPI.Comm, recorder: Recorder, offset: float) -> np.ndarray | None:
    """Every rank's events, times plus `offset`, sorted by (start, rank) on rank 0; None elsewhere.

    With offset = clock_offset(comm) the times read rank 0's clock; pass clock_offset(comm) - t0,
    t0 being the run's start on rank 0's clock, for seconds since the run started.
    """
    from mpi4py import MPI

    rows = recorder.events.copy()
    rows["start"] += offset
    rows["end"] += offset
    is_root = comm.rank == 0

    counts = np.zeros(comm.size, dtype=np.int64) if is_root else None
    comm.Gather(np.array([len(rows)], dtype=np.int64), counts, root=0)
    # counted in rows, not bytes, so a long trace does not overflow MPI's int counts
    row_type = MPI.BYTE.Create_contiguous(EVENT_DTYPE.itemsize).Commit()
    try:
        if is_root:
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
            gathered = np.zeros(int(counts.sum()), dtype=EVENT_DTYPE)
            recvbuf = [gathered.view(np.uint8), (counts, displs), row_type]
        else:
            recvbuf = None
        comm.Gatherv([rows.view(np.uint8), len(rows), row_type], recvbuf, root=0)
    finally:
        row_type.Free()
    if not is_root:
        return None

    return gathered[np.lexsort((gathered["rank"], gathered["start"]))]
