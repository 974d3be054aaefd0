"""The `mpihybrid` command: the group (each command's module loads on first use), the exit
codes and the ways every rank leaves together.

mpiexec -n 4 mpihybrid train                                  # cli/run.py
mpihybrid schedule show --schedule 1f1b --pp 4 --microbatches 8  # cli/schedule.py
mpiexec -n 4 mpihybrid bench allreduce                        # cli/bench_commands.py
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import time
import traceback
from typing import NoReturn

import click

from mpihybrid import temps
from mpihybrid.comm.agree import first_error

EXIT_FAILED = 1  # the run stopped (nan, a refused checkpoint) or a rank failed (job aborted)
EXIT_USAGE = 2
EXIT_PREEMPTED = 3  # a signal asked the job to stop; a checkpoint was written (requeue me)
# bounds of the bench commands' counts and sizes (a typo must not start a day-long run)
MAX_REPEATS = 10_000
MAX_STEPS = 100_000
MAX_SIZES = 64  # bench allreduce --sizes (each size: what the node's memory holds)
ABORT_DRAIN_S = 0.25  # _abort: time for the launcher to pass a read line on
DRAIN_LIMIT_S = 5.0  # _abort: the longest wait for the launcher to read a rank's output
DEBUG_ENV = "MPIHYBRID_DEBUG"  # set (not 0): a failing rank prints its full traceback


def _fail(message: str, rank: int = 0) -> None:
    """One line on stderr (from rank 0 only, under mpiexec) and exit 2 everywhere."""
    if rank == 0:
        click.echo(f"mpihybrid: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def _launcher_rank() -> int:
    """This process's rank as the MPI launcher told it (0 outside a launch), without MPI_Init."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class LazyGroup(click.Group):
    """Commands living in other modules load on first use (keeps `--help` and `train` fast)."""

    lazy = {
        "train": "mpihybrid.cli.run:train",
        "schedule": "mpihybrid.cli.schedule:schedule",
        "bench": "mpihybrid.cli.bench_commands:bench",
        "analyze": "mpihybrid.cli.trace:analyze",
        "timeline": "mpihybrid.cli.trace:timeline",
        "export": "mpihybrid.cli.trace:export",
        "compare": "mpihybrid.cli.trace:compare",
        "sweep": "mpihybrid.cli.sweep:sweep",
        "predict": "mpihybrid.cli.predict:predict",
        "data": "mpihybrid.cli.text:data",
        "generate": "mpihybrid.cli.text:generate",
        "weights": "mpihybrid.cli.weights:weights",
        "why": "mpihybrid.cli.why:why",
        "whatif": "mpihybrid.cli.whatif:whatif",
    }

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Under mpiexec every rank parses the same command line: only rank 0 shows a usage
        error (all exit 2)."""
        try:  # MPIHYBRID_KERNELS is read when the kernels' switch is imported: a bad value
            from mpihybrid import _numba  # noqa: F401  (or numba asked for, not there) is usage
        except ImportError as exc:
            _fail(str(exc), _launcher_rank())
        if not standalone_mode or _launcher_rank() == 0:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            return super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            sys.exit(1)

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, attr = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mpihybrid")
def main() -> None:
    """Hybrid pipeline + data-parallel training over MPI, traced to HDF5."""


def exit_stopped(world, exc) -> NoReturn:
    """Every rank stopped together (train.loop.StopRequested): rank 0 says why, all exit with
    the stop's code (a preemption's line on stdout, where the SLURM log expects it)."""
    if world.rank == 0:
        if exc.exit_code == EXIT_PREEMPTED:
            click.echo(str(exc))
        else:
            failed = exc.exit_code == EXIT_FAILED
            click.echo(f"mpihybrid: {'error: ' if failed else ''}{exc}", err=True)
    sys.exit(exc.exit_code)


_BOUND: list = []  # the file faulthandler's last resort writes to, kept open to the exit
END_FLOOR_S, FINALIZE_S = 10.0, 30.0  # rank 0's report may take a moment on a loaded machine


def bound_the_exit(world, timeout_s: float) -> None:
    """Collective, the run's last act before MPI_Finalize: every rank waits for all to get here
    (a nonblocking barrier, polled) for at most comm.timeout_s, END_FLOOR_S at least (0:
    unbounded, as the watchdog). The watchdog stopped with the run, so a rank stopped now
    (SIGSTOP, a hung disk) would hold the job for good: the others instead say so in one line
    and abort the job, which makes the launcher end the stopped rank too. Past the barrier
    faulthandler's timer, a C thread that needs no interpreter lock, bounds MPI_Finalize itself
    (FINALIZE_S more; exit 1)."""
    import faulthandler

    if timeout_s <= 0 or _BOUND:
        return
    bound = max(timeout_s, END_FLOOR_S)
    request, deadline = world.Ibarrier(), time.monotonic() + bound
    while not request.Test():
        if time.monotonic() > deadline:
            sys.stderr.write(
                f"mpihybrid: error: rank {world.rank}: not every rank reached the end within "
                f"{bound:g} s after the run (one stopped?): ending the job\n"
            )
            sys.stderr.flush()
            _abort(world)
        time.sleep(0.005)
    _BOUND.append(open(os.devnull, "w"))  # noqa: SIM115 -- open until the process ends
    # a year at most: faulthandler refuses a timeout past its clock's range (1e12 s)
    faulthandler.dump_traceback_later(min(bound + FINALIZE_S, 3.2e7), exit=True, file=_BOUND[0])


def _debug_env() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def abort_job(world, exc: BaseException, what: str, debug: bool) -> NoReturn:
    """One rank failed where the others may wait in a collective: one line on stderr (the rank,
    the step, the error; the full traceback with --debug or MPIHYBRID_DEBUG=1), MPI_Abort for
    the whole job (_abort)."""
    step = getattr(exc, "step", None)
    where = f"rank {world.rank}" + (f", step {step}" if step is not None else "")
    if debug:
        sys.stderr.write(traceback.format_exc())
    record = getattr(exc, "flight_record", None)  # an untraced run's, in the temporary dir
    said = f" (flight record: {record})" if record else ""
    sys.stderr.write(f"mpihybrid: error: {what} failed on {where}: {_one_line(exc)}{said}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    _abort(world)


def _unread(fd: int) -> int | None:
    """Bytes written to `fd` that its reader has not read yet: a pipe's (the launcher's, under
    Hydra and Open MPI alike); None where `fd` is no pipe (a file, a terminal)."""
    import fcntl
    import stat
    import struct
    import termios

    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError):
        return None


def drain_output(limit_s: float = DRAIN_LIMIT_S, fds: tuple[int, ...] = (1, 2)) -> None:
    """Wait until the launcher has read what this rank wrote to stdout and stderr (at most
    limit_s), then ABORT_DRAIN_S for it to pass the lines on; ABORT_DRAIN_S alone where the
    streams are no pipes. The launcher forwards a rank's output on its own time, and MPI_Abort
    can end the forwarding first: a rank's last line was lost so once in a loaded test run
    (abort_job) and once in CI (bound_the_exit), with a fixed 0.25 s wait."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        unread = [_unread(fd) for fd in fds]
        if not any(unread):  # all read, or no pipes to ask
            break
        time.sleep(0.01)
    time.sleep(ABORT_DRAIN_S)


def _abort(world) -> NoReturn:
    """MPI_Abort for the whole job once this rank's last line is out (drain_output, on the
    failure paths only); then leave at once, as MPI_Abort returns under some MPIs (the PyPI
    MPICH)."""
    drain_output()
    temps.remove_all()  # os._exit skips atexit
    try:
        world.Abort(EXIT_FAILED)
    finally:
        os._exit(EXIT_FAILED)


def _one_line(exc: BaseException) -> str:
    """An exception as one line; an MPI error says which rank stopped answering where MPI
    names it (a peer killed by the OS, say)."""
    from mpi4py import MPI

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, MPI.Exception):
        peer = re.search(r"rank (\d+)", text)
        who = f"rank {peer.group(1)}" if peer else "another rank"
        return f"{who} stopped answering (MPI: {text[:200]})"
    if isinstance(exc, MemoryError):
        return f"out of memory ({text})"
    return f"{type(exc).__name__}: {text}"


def exit_on_any_error(world, error: str | None) -> None:
    """Collective: every rank passes its own error (or None). If any rank has one, all exit
    with status 2 together and rank 0 prints the first, so no rank is left waiting."""
    first = first_error(world, error)
    if first is not None:
        if world.rank == 0:
            click.echo(f"mpihybrid: error: {first}", err=True)
        sys.exit(EXIT_USAGE)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _setup_logging(rank: int, quiet: bool) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[r{rank}] %(message)s"))
    logger = logging.getLogger("mpihybrid")
    logger.handlers[:] = [handler]
    # --quiet drops the per-step lines (train() asks); a resume or a checkpoint still shows
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


if __name__ == "__main__":  # pragma: no cover
    main()
