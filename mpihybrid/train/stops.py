"""How a run stops when every rank agrees to: what the ranks' signals ask for, and the exceptions
that carry it to the CLI with its exit code.

    counts = signal_counts(signals)     # this rank's [SIGUSR1, SIGTERM, SIGINT]
    stop = agreed_stop(job, summed)     # "interrupt", "preempt", "terminate" or None
    raise stop_exception(stop, step, path)   # Interrupted / Preempted / Terminated
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.codecs import overflow_hint
from mpihybrid.config import Job
from mpihybrid.train.watchdog import EXIT_INTERRUPTED, StopSignals


class StopRequested(Exception):
    """Every rank stopped together at a step boundary they agreed on; `exit_code` is the CLI's
    and the message is one line for the user."""

    exit_code = 1

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class TrainingStopped(StopRequested):
    """The run cannot go on: a non-finite loss or gradient, a checkpoint the file system
    refused."""


class Preempted(StopRequested):
    """A preemption signal (SIGUSR1, SIGTERM): a checkpoint was written (or, before the first
    step, nothing new was there to write); requeue and resume."""

    exit_code = 3

    def __init__(self, step: int, path: str | None):
        if path:
            text = f"preempted at step {step}: checkpoint written to {path}"
        else:
            text = f"preempted before step {step + 1}: no step had run, nothing new to write"
        super().__init__(step, text)
        self.path = path


class Interrupted(StopRequested):
    """SIGINT (Ctrl-C, or a signal to mpiexec): stopped at the next step boundary."""

    exit_code = EXIT_INTERRUPTED


class Terminated(StopRequested):
    """SIGTERM with no checkpoint.dir: stopped at the next step boundary, nothing saved."""

    exit_code = 143


def signal_counts(signals: StopSignals | None) -> list[int]:
    """SIGUSR1, SIGTERM and SIGINT as this rank's handler saw them (the step's vector)."""
    return [0, 0, 0] if signals is None else [signals.usr1, signals.term, signals.interrupts]


def agreed_stop(job: Job, counts: np.ndarray) -> str | None:
    """What the signals of all ranks (summed) ask for: "interrupt" (SIGINT: stop, exit 130),
    "preempt" (SIGUSR1 or SIGTERM with a checkpoint.dir: checkpoint, exit 3), "terminate"
    (SIGTERM with nowhere to checkpoint: stop, exit 143), or None (SIGUSR1 without a
    checkpoint.dir is only warned about)."""
    usr1, term, interrupts = (int(c) for c in counts)
    has_dir = bool(job.checkpoint.dir)
    if has_dir and (usr1 or term):
        return "preempt" if not interrupts else "interrupt"
    if interrupts:
        return "interrupt"
    return "terminate" if term else None


def stop_exception(stop: str, step: int, path: str | None) -> StopRequested:
    if stop == "interrupt":
        saved = f"; checkpoint written to {path}" if path else " (no checkpoint written)"
        return Interrupted(step, f"interrupted at step {step}{saved}")
    if stop == "terminate":
        return Terminated(
            step,
            f"terminated by SIGTERM at step {step} (no checkpoint.dir: nothing to resume from)",
        )
    return Preempted(step, path)


def stop_nonfinite(world: MPI.Comm, job: Job, step: int, loss_sum: float, bad: list[int]):
    """Collective, on every rank alike: name the step and the stages, raise TrainingStopped."""
    stages = sorted({s for part in world.allgather(bad) for s in part})
    if not math.isfinite(loss_sum):
        last = job.grid.pp * job.train.virtual_stages - 1
        what = f"the loss is {loss_sum} (stage {last}, the last)"
    else:
        what = f"the gradient of stage {', '.join(map(str, stages))} is not finite (nan or inf)"
        hint = overflow_hint(job.comm.codec)
        what += f" ({hint})" if hint else ""
    raise TrainingStopped(
        step + 1, f"step {step + 1}: {what}; stopped without writing a checkpoint of these weights"
    )
