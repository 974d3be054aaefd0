"""The one resolution: a job file, its overrides and the world become the job a command runs.

    job, notes = resolve_job(job_file, overrides, world)   # collective: train, bench train, sweep
    job, notes = rewrite(job, world)                       # collective: a job already loaded
    job = resolve_offline(job_file, overrides)             # one process: predict, schedule search

In this order, once, every command alike:
1. load and validate (config.load_job) on every rank; the first error agreed: one line, exit 2;
2. a resumed checkpoint's settings where the job does not give them: its global batch and its
   learning-rate horizon (train.resume; `resumed=False` leaves them: a benchmark resumes nothing);
3. train.schedule = "auto": searched (and calibrated) on rank 0, the same schedule and split
   given to every rank (cli/auto.py);
4. model.partition = "timed": measured on rank 0, the same counts given to every rank;
5. grid.order = "auto": predicted on rank 0 (predict.auto), the same order on every rank.
`notes` holds what the trace keeps of it (`order_choice`, the line that says which order ran).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import click

from mpihybrid.cli.commands import _debug_env, abort_job, exit_on_any_error, exit_stopped
from mpihybrid.comm.agree import rank0_decides


def resolve_job(
    job_file: str | None, overrides: list[str], world, *, resumed: bool = True, check=None
) -> tuple[object, dict]:
    """Collective: the job every rank runs, resolved (steps 1-5 above), and its notes.
    `check(job)`: the command's own refusals of the loaded job (a ConfigError), agreed as
    step 1's are, before anything is searched or timed."""
    from mpihybrid.config import ConfigError, load_job
    from mpihybrid.train.resume import (
        batch_given,
        given,
        init_not_read,
        keep_recorded_batch,
        keep_recorded_horizon,
    )

    error, job = None, None
    if resumed:  # a resume starts from its checkpoint's weights, not model.init's file
        # (a checkpoint.dir rank 0 cannot list: none dropped, the resume says what is wrong)
        dropped, _ = rank0_decides(
            world, lambda: init_not_read(job_file, overrides), expected=(OSError,)
        )
        overrides = [*overrides, *(dropped or [])]
    try:
        job = load_job(job_file, overrides, world.Get_size())
        if check is not None:
            check(job)
    except ConfigError as exc:
        error = str(exc)
    exit_on_any_error(world, error)
    if resumed:
        try:  # a resume at another dp keeps the checkpoint's default global batch
            job = keep_recorded_batch(job, world, batch_given(job_file, overrides))
            job = keep_recorded_horizon(job, world, given(job_file, overrides, "lr_decay_steps"))
        except ConfigError as exc:
            error = str(exc)
        exit_on_any_error(world, error)
    return rewrite(job, world)


def rewrite(job, world) -> tuple[object, dict]:
    """Collective: the rewrites rank 0 decides for all (steps 3-5 above) of a loaded job."""
    job = _timed_partition(_auto_schedule(job, world), world)  # before checkpoints
    job, order_choice = _auto_order(job, world)
    return job, ({"order_choice": order_choice} if order_choice else {})


def _auto_schedule(job, world):
    """train.schedule = "auto" searched on rank 0 and the same schedule and split given to
    every rank (cli/auto.py); bad costs or a limit no schedule meets: one line, exit 2 on
    every rank. Any other schedule as it is."""
    from mpihybrid.cli.auto import resolve_auto
    from mpihybrid.config import AUTO, ConfigError
    from mpihybrid.train.stops import StopRequested

    if job.train.schedule != AUTO:
        return job
    if world.rank == 0:
        from mpihybrid.pipeline.search_exact import solver_missing

        missing = solver_missing()
        if missing:  # as `schedule search` says it: the run goes on with the greedy's schedule
            click.echo(
                f"mpihybrid: train.schedule = 'auto': the exact search is not installed "
                f"({missing}); the greedy list scheduler's schedule runs",
                err=True,
            )
    try:
        return resolve_auto(job, world)
    except ConfigError as exc:  # the same on every rank (rank 0's, broadcast)
        exit_on_any_error(world, str(exc))
    except StopRequested as exc:  # a signal in the calibration steps: every rank alike
        exit_stopped(world, exc)
    except BaseException as exc:  # one rank alone (a SystemExit too), the others waiting
        abort_job(world, exc, "searching the schedule", _debug_env())


def _timed_partition(job, world):
    """model.partition = "timed" fixed as rank 0 measures it (or as the checkpoint to resume
    was split), the same on every rank; any other partition as it is."""
    from mpihybrid.train.partition import resolve_partition

    if job.model.partition != "timed":
        return job
    try:  # no failure expected: one ends the job (the others wait in rank 0's broadcast)
        counts, _ = rank0_decides(
            world, lambda: resolve_partition(job).model.partition, expected=()
        )
    except Exception as exc:
        abort_job(world, exc, "timing the model's blocks", _debug_env())
    logging.getLogger("mpihybrid").info(
        "model.partition = 'timed': %s layers per chunk (embedding with the first, head with "
        "the last)",
        counts,
    )
    return dataclasses.replace(job, model=dataclasses.replace(job.model, partition=counts))


def _auto_order(job, world):
    """grid.order = "auto" chosen (predict.auto; collective), said by rank 0 in one line: (the
    job, the line); any other order: (the job, "")."""
    from mpihybrid.predict.auto import resolve_order

    job, line = resolve_order(job, world)
    if line and world.rank == 0:
        click.echo(f"mpihybrid: {line}", err=True)
    return job, line


def job_path(job_file: str) -> str:
    """JOB_FILE as given, or where it does not exist, the example job of that name installed
    with the package (`jobs/gpt_bench.toml`, `gpt_bench.toml` or `gpt_bench`)."""
    if Path(job_file).exists():
        return job_file
    name = Path(job_file).name
    packaged = (
        Path(__file__).resolve().parent.parent
        / "jobs"
        / (name if name.endswith(".toml") else f"{name}.toml")
    )
    return str(packaged) if packaged.is_file() else job_file


def resolve_offline(job_file: str, overrides: list[str], *, timed: bool = True):
    """One process, no world: the job for the world its grid names (pp x dp; dp = -1 is refused,
    there is no mpiexec to take it from), a timed partition measured here (`timed=False`
    leaves it). A ConfigError (a ValueError) for bad input."""
    from mpihybrid.config import build_job, load_table, resolve
    from mpihybrid.train.partition import resolve_partition

    job = build_job(load_table(job_path(job_file)), overrides)
    if job.grid.dp == -1:
        raise ValueError("grid.dp = -1 takes the world size from mpiexec: give --set grid.dp=N")
    job = resolve(job, job.grid.pp * max(job.grid.dp, 1))
    return resolve_partition(job) if timed else job
