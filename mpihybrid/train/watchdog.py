"""Nothing waits forever: the stop signals and the watchdog thread (the flight record it writes
is train.flight).

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

Work that runs long without an action ending (an evaluation, a checkpoint file, a trace flush, a
schedule search) tells the watchdog it is progressing through mpihybrid.progress, from any layer.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mpihybrid import temps
from mpihybrid.progress import TICK_S, watch, watched
from mpihybrid.train.flight import FlightRecorder, describe

log = logging.getLogger("mpihybrid")

PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
INTERRUPT = signal.SIGINT
EXIT_INTERRUPTED = 130  # what a shell reports for a job ended by Ctrl-C (128 + SIGINT)
SUSPENDED_S = 2.0  # a tick this much later than asked: the process was stopped, not slow


class StopSignals:
    """Every stop signal of the process, from `install()` until it exits: flags, never exits.

    `usr1`, `term` and `interrupts` count SIGUSR1, SIGTERM and SIGINT as the main thread's
    handler saw them. The watchdog thread reads the same signals from the wakeup pipe the moment
    they come, even while the main thread is blocked inside MPI and its handler cannot run."""

    _installed: StopSignals | None = None

    def __init__(self) -> None:
        self.usr1 = self.term = self.interrupts = 0
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
        if signum == INTERRUPT:
            self.interrupts += 1
        elif signum == signal.SIGTERM:
            self.term += 1
        else:
            self.usr1 += 1


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
        *,
        usr1_stops: bool = True,
        grace_s: float = 10.0,
        tick_s: float = TICK_S,
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
        self.boundaries = 0  # step boundaries reached (the first is the start of the steps)
        self.settled = False  # the ranks agreed to stop, or training is over: no grace applies
        self.usr1_stops = usr1_stops
        self.stop_asked_at: float | None = None  # the first signal that asks for a stop
        self.first_interrupt_at: float | None = None
        self.forced = False  # a second interrupt, over a second after the first
        self._stop = threading.Event()
        # stop() wakes the thread's select() through a pipe (made by start()): without it every
        # run's end waited for the thread's next tick (up to a second a process)
        self._wake: tuple[int, int] | None = None
        self._warned: tuple | None = None  # the open row a "waited long" warning named
        self._looked_at: float | None = None  # the thread's last look
        self.resumed_at = float("-inf")  # when this process last woke from a suspension
        self._thread = threading.Thread(target=self._loop, name="mpihybrid-watchdog", daemon=True)

    def start(self) -> Watchdog:
        watch(self.flight)
        # the thread's first tick is measured from here: a process stopped before that tick
        # (a tiny job's step 3 comes 0.15 s after the start) was otherwise never seen suspended
        self._looked_at = time.monotonic()
        self._wake = os.pipe()
        self._thread.start()
        return self

    def stop(self) -> None:
        if watched() is self.flight:
            watch(None)
        self._stop.set()
        wake, self._wake = self._wake, None
        if wake is None:
            return  # never started, or stopped already
        os.write(wake[1], b"x")  # the thread may sit in select() for up to a tick
        self._thread.join()
        for end in wake:
            os.close(end)

    def at_boundary(self) -> None:
        """The main thread reached a step boundary (the signals' grace restarts from here)."""
        now = time.monotonic()
        took = now - self.boundary_at
        self.slowest_step = max(self.slowest_step, took)
        self.boundary_at = now
        self.boundaries += 1
        if self.boundaries == 2 and 0 < self.timeout_s < took and self.flight.rank == 0:
            log.warning(
                "comm.timeout_s = %g is below the first step's %.1f s: a step whose actions "
                "take that long without one ending is ended as a stall; raise it",
                self.timeout_s,
                took,
            )

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
        woken = self._wake[0]
        while not self._stop.is_set():
            if fd >= 0:
                ready, _, _ = select.select([fd, woken], [], [], self.tick_s)
                if fd in ready:
                    self._read_signals(fd)
            elif self._stop.wait(self.tick_s):
                break
            if not self._stop.is_set():
                self.look(time.monotonic())

    def look(self, now: float) -> None:
        """One tick of the thread. A tick that comes far later than asked means this process was
        suspended (SIGSTOP, a paused host; Open MPI's mpiexec sends SIGCONT before it ends a job):
        the time it slept is not this rank's stall, and blaming it on the wait it was in would
        name the wrong rank, so the stall clock restarts from the wake-up."""
        last, self._looked_at = self._looked_at, now
        if last is not None and now - last > self.tick_s + max(SUSPENDED_S, self.tick_s):
            self.resumed_at = now
        self.check(now)

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
        idle = now - max(self.flight.last_activity, self.resumed_at)
        row = self.flight.open_row()
        if self.timeout_s > 0 and idle > self.timeout_s:
            self.fire(
                f"no progress for {idle:.0f} s (comm.timeout_s = {self.timeout_s:g}): "
                f"{self._waiting(now)}",
                1,
            )
        if row is not None and idle > self.warn_s and self._warned is not row:
            self._warned = row
            log.warning("rank %d has waited %.0f s: %s", self.flight.rank, idle, describe(row))
        elif self._warned is not None and row is not self._warned:
            start = self._warned[0]
            log.warning(
                "rank %d: a long wait ended after %.1f s: %s",
                self.flight.rank,
                time.time() - start,
                describe(self._warned),
            )
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
        temps.remove_all()  # this process's temporaries (an exit skips atexit)
        try:
            self.abort(code)
        except Exception:  # the job must end all the same
            pass
        self.exit(code)  # MPI_Abort returns under some MPIs (the PyPI MPICH)
