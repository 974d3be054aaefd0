"""A resume at another data-parallel width keeps the run's global batch.

    job = keep_recorded_batch(job, world, batch_given(job_file, overrides))   # collective

The embedded job's global batch follows dp (config.SAMPLES_PER_REPLICA a replica) when no job
file or `--set` gives it; resumed at another dp, that default would be another job's batch. A
job that leaves it at its default takes the global batch its newest checkpoint recorded (one
line says so), so the same command resumes at any dp that divides it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from mpihybrid.config import ConfigError, Job, load_table, parse_override, tomllib
from mpihybrid.config.rules import validate
from mpihybrid.train.checkpoint import CheckpointError, complete, read_manifest

log = logging.getLogger("mpihybrid")


def batch_given(path: str | Path | None, overrides: list[str]) -> bool:
    """Whether the job file or an override sets train.global_batch (else: the default)."""
    train = load_table(path).get("train", {})
    return (isinstance(train, dict) and "global_batch" in train) or any(
        parse_override(o)[:2] == ("train", "global_batch") for o in overrides
    )


def recorded_global_batch(job: Job) -> int | None:
    """train.global_batch of the newest complete checkpoint in checkpoint.dir (its stored job);
    None when there is none, or it is damaged or does not say (the resume then says why)."""
    found = complete(job.checkpoint.dir) if job.checkpoint.dir else []
    if not found:
        return None
    try:
        stored = tomllib.loads(read_manifest(found[-1])["job"])["train"]["global_batch"]
    except (CheckpointError, KeyError, TypeError, AttributeError, tomllib.TOMLDecodeError):
        return None
    ok = isinstance(stored, int) and not isinstance(stored, bool) and stored > 0
    return stored if ok else None


def keep_recorded_batch(job: Job, world, given: bool) -> Job:
    """Collective: `job` with the checkpoint's global batch when `given` is False and the newest
    checkpoint recorded another; ConfigError on every rank alike when it does not split over
    this dp (the line says how to choose another)."""
    stored = recorded_global_batch(job) if world.rank == 0 and not given else None
    stored = world.bcast(stored, root=0)
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
            "follows dp: %d at dp = %d)", stored, t.global_batch, job.grid.dp,
        )  # fmt: skip
    return resumed
