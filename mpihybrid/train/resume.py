"""A resume keeps what the run it continues chose by default: its global batch (at another
data-parallel width) and its learning rate's horizon (with another train.steps).

    job = keep_recorded_batch(job, world, batch_given(job_file, overrides))   # collective
    job = keep_recorded_horizon(job, world, given(job_file, overrides, "lr_decay_steps"))

The embedded job's global batch follows dp (config.SAMPLES_PER_REPLICA a replica) when no job
file or `--set` gives it; resumed at another dp, that default would be another job's batch. A
job that leaves it at its default takes the global batch its newest checkpoint recorded (one
line says so), so the same command resumes at any dp that divides it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from mpihybrid.comm.agree import rank0_decides
from mpihybrid.config import ConfigError, Job, load_table, parse_override, tomllib
from mpihybrid.config.rules import validate
from mpihybrid.train.checkpoint import CheckpointError, complete, read_manifest

log = logging.getLogger("mpihybrid")


def given(path: str | Path | None, overrides: list[str], key: str) -> bool:
    """Whether the job file or an override sets train.<key> (else: the default)."""
    train = load_table(path).get("train", {})
    return (isinstance(train, dict) and key in train) or any(
        parse_override(o)[:2] == ("train", key) for o in overrides
    )


def batch_given(path: str | Path | None, overrides: list[str]) -> bool:
    return given(path, overrides, "global_batch")


def _recorded(job: Job, key: str, default_key: str | None = None) -> int | None:
    """train.<key> (when 0 or absent: train.<default_key>) of the newest complete checkpoint in
    checkpoint.dir (its stored job); None when there is none, or it is damaged or does not say
    (the resume then says why)."""
    found = complete(job.checkpoint.dir) if job.checkpoint.dir else []
    if not found:
        return None
    try:
        train = tomllib.loads(read_manifest(found[-1])["job"])["train"]
        stored = train.get(key) or (train[default_key] if default_key else None)
    except (CheckpointError, KeyError, TypeError, AttributeError, tomllib.TOMLDecodeError):
        return None
    ok = isinstance(stored, int) and not isinstance(stored, bool) and stored > 0
    return stored if ok else None


def _agreed_record(world, job: Job, key: str, default_key: str | None = None) -> int | None:
    """Collective: _recorded as rank 0 reads it, the same on every rank; a checkpoint.dir it
    cannot read is a ConfigError on every rank alike."""
    stored, error = rank0_decides(
        world, lambda: _recorded(job, key, default_key), expected=(OSError,)
    )
    if error is not None:
        raise ConfigError(f"checkpoint.dir = {job.checkpoint.dir!r}: {error}")
    return stored


def keep_recorded_horizon(job: Job, world, given: bool) -> Job:
    """Collective: a decaying rate (train.lr_schedule cosine or linear) resumed with another
    train.steps keeps the horizon of the run it continues (the step its decay ends at, min_lr
    after it: nanoGPT's lr_decay_iters), unless train.lr_decay_steps is given; one line says so.
    A resumed run's rates are then the uninterrupted run's, whatever train.steps says now."""
    t = job.train
    if given or t.lr_schedule == "constant":
        return job
    stored = _agreed_record(world, job, "lr_decay_steps", "steps")
    if stored is None or stored == t.steps or stored <= t.warmup_steps:
        return job
    if world.rank == 0:
        log.info(
            "train.lr_schedule = %s: the rate decays to train.min_lr at step %d, as in the run "
            "this resumes (train.steps = %d now; train.lr_decay_steps sets another horizon)",
            t.lr_schedule,
            stored,
            t.steps,
        )
    return dataclasses.replace(job, train=dataclasses.replace(t, lr_decay_steps=stored))


def keep_recorded_batch(job: Job, world, given: bool) -> Job:
    """Collective: `job` with the checkpoint's global batch when `given` is False and the newest
    checkpoint recorded another; ConfigError on every rank alike when it does not split over
    this dp (the line says how to choose another)."""
    stored = None if given else _agreed_record(world, job, "global_batch")  # given: alike
    t = job.train
    if stored is None or stored == t.global_batch:
        return job
    resumed = dataclasses.replace(job, train=dataclasses.replace(t, global_batch=stored))
    try:
        validate(resumed)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}: train.global_batch = {stored} is the checkpoint's, kept when a resume leaves "
            "it at its default; set train.global_batch to resume with another batch"
        ) from None
    if world.rank == 0:
        log.info(
            "train.global_batch = %d, as the checkpoint recorded (left at its default, which "
            "follows dp: %d at dp = %d)",
            stored,
            t.global_batch,
            job.grid.dp,
        )
    return resumed


def init_not_read(path: str | Path | None, overrides: list[str]) -> list[str]:
    """model.init is where a run's weights start; a run that resumes from a complete checkpoint
    in checkpoint.dir starts from that one's, so the file is neither read nor needed (moved,
    spelled `./x` or left out): the override that drops it, said in one line, or []."""
    from mpihybrid.config import build_job

    try:
        job = build_job(load_table(path), overrides)
    except (ConfigError, OSError):
        return []  # load_job says what is wrong
    if not job.model.init or not job.checkpoint.dir or not complete(job.checkpoint.dir):
        return []
    log.info(
        "model.init = %r is not read: the run resumes from the weights in checkpoint.dir = %r",
        job.model.init,
        job.checkpoint.dir,
    )
    return ['model.init=""']
