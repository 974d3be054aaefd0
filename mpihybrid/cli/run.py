"""`mpihybrid train`: every rank validates the job, rank 0 checks the file system, all agree
on the first error, then train; every way a run ends maps to one line and an exit code.

    mpiexec -n 4 mpihybrid train                                  # embedded default job
    mpiexec -n 12 mpihybrid train jobs/seed_k3_d4.toml --trace runs/seed.h5
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from mpihybrid.cli.commands import (
    DEBUG_ENV,
    EXIT_USAGE,
    _debug_env,
    _quote,
    _setup_logging,
    abort_job,
    bound_the_exit,
    exit_on_any_error,
    exit_stopped,
)
from mpihybrid.cli.options import set_option
from mpihybrid.comm.agree import rank0_decides
from mpihybrid.files import release_all


@click.command()
@click.argument("job_file", required=False)
@set_option()
@click.option("--trace", "trace_path", metavar="PATH", help="Write the run's HDF5 trace here.")
@click.option("--overwrite", is_flag=True, help="Replace an existing trace file.")
@click.option(
    "--quiet", is_flag=True, help="No per-step progress lines (resumes and warnings still show)."
)
@click.option(
    "--resume",
    is_flag=True,
    help="Require a checkpoint in checkpoint.dir to continue from (a run resumes from "
    "the newest intact one there anyway).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Resume from checkpoint.dir even when its job differs from this one in more than the "
    "settings a resume may change (the refusal names them).",
)
@click.option(
    "--debug",
    is_flag=True,
    help=f"On a failure, print the full traceback, not one line (also {DEBUG_ENV}=1).",
)
def train(*, job_file, overrides, trace_path, overwrite, quiet, resume, force, debug) -> None:
    """Train JOB_FILE (TOML; the embedded default job when omitted) on every rank of mpiexec.

    Ctrl-C (or SIGINT to mpiexec) stops every rank at the next step boundary, trace written,
    exit 130 (twice: at once); SIGUSR1/SIGTERM checkpoint there and exit 3. A rank that makes
    no progress for comm.timeout_s ends the job saying what it waits on (`mpihybrid why`)."""
    from mpihybrid.train.watchdog import StopSignals

    StopSignals.install()  # before MPI starts: no moment of the run takes a signal's default
    from mpi4py import MPI

    from mpihybrid.cli.resolve import resolve_job
    from mpihybrid.config import ConfigError
    from mpihybrid.trace.read import TraceError
    from mpihybrid.train.checkpoint import CheckpointError
    from mpihybrid.train.memory import check_fits

    world = MPI.COMM_WORLD
    _setup_logging(world.rank, quiet)
    overrides = list(overrides)
    if trace_path is not None:
        overrides.append(f"trace.path={_quote(trace_path)}")
    if overwrite:
        overrides.append("trace.overwrite=true")
    # Every rank validates the same inputs; rank 0 also checks the file system. All ranks then
    # agree on the first error, so they exit together before any message of training is sent.
    job, notes = resolve_job(job_file, overrides, world)  # collective
    try:  # rank 0 looks at the file system: the checkpoint to resume, the trace's file
        resume_from, error = rank0_decides(
            world,
            lambda: _preflight(job, resume, force),
            expected=(ConfigError, CheckpointError, TraceError, OSError),
            describe=_refused,
        )
    except Exception as exc:  # rank 0 alone, while the others wait in its broadcast: end them all
        abort_job(world, exc, "checking the job", debug or _debug_env())
    exit_on_any_error(world, error)
    try:
        check_fits(job, world)  # collective: the same verdict on every rank
    except ConfigError as exc:
        exit_on_any_error(world, str(exc))
    summary = _run_training(
        job, world, quiet=quiet, resume_from=resume_from, debug=debug or _debug_env(), notes=notes
    )
    release_all()  # rank 0's locks on checkpoint.dir and the trace (exit drops them too)
    if summary is not None:
        from mpihybrid.train.report import format_report

        click.echo(format_report(job, summary))
    bound_the_exit(world, job.comm.timeout_s)  # no rank stopped now holds the job for good


def _run_training(job, world, *, quiet: bool, resume_from, debug: bool, notes=None):
    """train() with every way it can end mapped to one line and an exit code: 3 preempted,
    130 interrupted, 143 terminated, 2 a checkpoint or device refused before training, 1 a run
    that stopped (all ranks agreed) or a rank that failed alone (then the whole job is aborted:
    an exception, but also a KeyboardInterrupt or a SystemExit on one rank)."""
    from mpihybrid.comm.device import DeviceError
    from mpihybrid.train.checkpoint import CheckpointError
    from mpihybrid.train.loop import StopRequested
    from mpihybrid.train.loop import train as run_training

    try:
        peak = _calibrated_gemm_flops() if job.grid.device == "cpu" else None
        return run_training(
            job, world, quiet=quiet, resume_from=resume_from, peak_flops=peak, notes=notes
        )
    except StopRequested as exc:  # every rank alike, at a step boundary
        bound_the_exit(world, job.comm.timeout_s)
        exit_stopped(world, exc)
    except (CheckpointError, DeviceError) as exc:  # on every rank alike, before any training
        if world.rank == 0:
            click.echo(f"mpihybrid: error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except BaseException as exc:
        abort_job(world, exc, "training", debug)


def _calibrated_gemm_flops() -> float | None:
    """One core's GEMM rate from this machine's calibrated cluster file (what `predict
    --calibrate` writes to the user's directory), for the step line's roofline share; None
    when there is none (the installed local.toml was fitted on another machine)."""
    from mpihybrid.predict.cluster import ClusterError, load_cluster, user_dir

    path = user_dir() / "local.toml"
    try:
        return load_cluster(path).device.gemm_flops if path.is_file() else None
    except (ClusterError, OSError):
        return None


def _refused(exc: BaseException) -> str:
    """_preflight's refusal as the line every rank exits with."""
    if isinstance(exc, FileExistsError):
        return f"{exc} (--overwrite replaces it)"
    return str(exc)


def _preflight(job, resume: bool, force: bool = False) -> list[str] | None:
    """Rank 0, before anything is built: create and test-write checkpoint.dir and the trace's
    temporary (exit 2 now, not a lost run later), lock both for this run (files.acquire_lock),
    remove partial checkpoints and temporaries of crashed runs, refuse another job's checkpoint
    or trace, and list the complete checkpoints to resume from, newest first (None: afresh)."""
    from mpihybrid.config import ConfigError
    from mpihybrid.files import acquire_lock, clean_stale_temporaries, probe_dir, probe_file
    from mpihybrid.nn.data import check_data
    from mpihybrid.nn.tokens import DataError
    from mpihybrid.trace.file import check_writable
    from mpihybrid.train import checkpoint

    try:  # token files: header, size, vocabulary, enough windows
        check_data(job.data, job.train.global_batch)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    root, candidates, manifest = job.checkpoint.dir, [], None
    if root:
        try:
            probe_dir(root)
            acquire_lock(root, f"checkpoint.dir {root}", is_dir=True)
        except OSError as exc:
            raise checkpoint.CheckpointError(f"checkpoint.dir = {root!r}: {exc}") from None
        for stale in checkpoint.clean_partials(root):
            logging.getLogger("mpihybrid").warning("removed %s (a crashed run's partial)", stale)
        candidates = [str(p) for p in reversed(checkpoint.complete(root))]
    if resume and not candidates:
        raise checkpoint.CheckpointError(
            f"--resume: no complete checkpoint in checkpoint.dir = {root!r}"
        )
    if job.model.init and not candidates:  # as a checkpoint's weights are checked on restore
        from mpihybrid.nn.weights import nonfinite_problem

        if wrong := nonfinite_problem(job.model.init):
            raise ConfigError(wrong)
    if candidates:  # refuse another model now; a damaged one is restore_all's to skip
        newest = Path(candidates[0])
        try:
            manifest = checkpoint.read_manifest(newest)
            checkpoint.check_compatible(manifest, job, newest)
            checkpoint.check_same_job(manifest, job, newest, force)
        except checkpoint.CheckpointDamaged:
            pass
    if job.trace.path:
        # a resumed run continues the trace already at its path: its own, not another run's
        check_writable(job.trace.path, job.trace.overwrite, bool(candidates))
        probe_file(job.trace.path)
        acquire_lock(job.trace.path, f"trace {job.trace.path}")
        clean_stale_temporaries(job.trace.path)
        if candidates and not job.trace.overwrite:
            checkpoint.check_trace_owner(job.trace.path, job)
    return candidates or None
