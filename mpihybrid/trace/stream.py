"""A trace written as the run goes: every rank's side of the flushes (collective), rank 0's file.

    stream = TraceStream(comm, recorder, writer)     # writer: a TraceWriter on rank 0, else None
    stream.begin(to_run_start, resume_step)          # publishes the header (rank 0)
    every step, at the boundary all ranks reach:     # (train.loop: after the step's Allreduce)
        stream.add_step(step, loss, accuracy)        # rank 0: the per-step metrics
        if stream.due(step, asked):                  # the same answer on every rank
            stream.flush()                           # gathers the events to rank 0, appends
    stream.finish(attrs)                             # the rest, finished = True

A flush gathers the recorders' rows to rank 0 (gather_events), so every rank must call it at the
same step: due() is a function of the step number and of `asked`, a flag the caller agreed on
(rank 0 raises it when flush_seconds have passed; the loop sums it in its per-step Allreduce).
Between flushes each recorder holds only the rows since the last one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from mpihybrid.trace.recorder import Recorder, gather_events

if TYPE_CHECKING:
    from mpi4py import MPI

    from mpihybrid.trace.file import TraceWriter

log = logging.getLogger("mpihybrid")


class TraceStream:
    """Flushes a run's events every `flush_steps` steps or `flush_seconds` seconds (0 = not by
    that rule); without a writer (no trace path) nothing is flushed and the recorder keeps all."""

    def __init__(
        self,
        comm: MPI.Comm,
        recorder: Recorder,
        writer: TraceWriter | None,
        writing: bool,
        flush_steps: int = 0,
        *,
        flush_seconds: float = 0.0,
    ) -> None:
        self.comm, self.recorder, self.writer = comm, recorder, writer
        self.writing = writing  # the same on every rank: whether rank 0 has a writer
        self.flush_steps, self.flush_seconds = flush_steps, flush_seconds
        self.to_run_start = 0.0  # seconds from this rank's clock to the trace's
        self._last_flush = Recorder.clock()
        self.stopped = ""  # rank 0: why its trace stopped (a refused flush); "" while it goes on
        self._steps: dict[str, list] = {"step": [], "loss": [], "accuracy": [], "step_time": []}
        self._evals: dict[str, list] = {}  # held-out losses since the last flush (/eval)

    def begin(
        self, to_run_start: float, resume_step: int | None = None, earlier: dict | None = None
    ) -> None:
        """The clock shift (clock_offset - run start) and, on rank 0, the file's first version:
        the run's settings and no events yet (after a resume from `resume_step`: the earlier
        trace up to that step, and `earlier` metrics by step where it has none), so a trace
        exists from the first step on."""
        self.to_run_start = to_run_start
        if self.writer is not None:
            self.writer.start(resume_step, earlier)
            self._write(self.recorder.events[:0], {}, None, False)
        self._last_flush = Recorder.clock()

    def _write(self, events, steps: dict, attrs: dict | None, finished: bool, evals=None) -> None:
        """Rank 0: one flush to the file; one the file system refuses (a full disk, a quota)
        stops the trace with one warning, and training goes on (the trace keeps every step up to
        its last flush; the others keep gathering, as they cannot know)."""
        if self.stopped:
            return
        try:
            self.writer.flush(events, steps, attrs, finished, evals)
        except OSError as exc:
            self.stopped = exc.strerror or str(exc)
            log.warning(
                "trace %s stopped: %s; training goes on, the trace keeps the steps up to its "
                "last flush",
                self.writer.path,
                self.stopped,
            )

    def add_step(self, step: int, loss: float, accuracy: float, **more: float) -> None:
        """Rank 0: the step's metrics, with its own duration (the recorder's last step row);
        `more`: further columns of /steps (lr: the step's learning rate)."""
        if self.writer is None:
            return
        for name, value in (
            ("step", step),
            ("loss", loss),
            ("accuracy", accuracy),
            ("step_time", self.recorder.last_step_time),
            *more.items(),
        ):
            self._steps.setdefault(name, []).append(value)

    def add_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Rank 0: a held-out evaluation after `step` (0-based), a row of /eval."""
        if self.writer is None:
            return
        for name, value in {"step": step, **metrics}.items():
            self._evals.setdefault(name, []).append(value)

    def asks(self) -> float:
        """1.0 on rank 0 once flush_seconds have passed since the last flush, else 0.0: what the
        loop agrees on (sums) before calling due()."""
        if self.writer is None or not self.flush_seconds:
            return 0.0
        return float(Recorder.clock() - self._last_flush >= self.flush_seconds)

    def due(self, step: int, asked: bool) -> bool:
        """Whether to flush after `step` (0-based): every rank gives the same answer."""
        if not self.writing:
            return False
        return asked or bool(self.flush_steps and (step + 1) % self.flush_steps == 0)

    def flush(self, attrs: dict | None = None, finished: bool = False) -> np.ndarray | None:
        """Collective: gather the rows since the last flush to rank 0 and append them to the file
        (rank 0 returns them, the others None); every recorder is emptied."""
        events = gather_events(self.comm, self.recorder, self.to_run_start)
        if not self.writing:
            return events
        self.recorder.clear()
        if self.writer is not None:
            steps = {name: np.asarray(values) for name, values in self._steps.items()}
            steps["step"] = steps["step"].astype(np.int64)
            evals = {name: np.asarray(values) for name, values in self._evals.items()}
            if evals:
                evals["step"] = evals["step"].astype(np.int64)
            self._write(events, steps, attrs, finished, evals)
            for values in self._steps.values():
                values.clear()
            self._evals.clear()
        self._last_flush = Recorder.clock()
        return events
