"""Whose checkpoint (and trace) is this: the job stored with it against this one. A resume may
change only RESUMABLE; anything else makes it another job's, refused with its differences."""

from __future__ import annotations

import os
from pathlib import Path

from mpihybrid.train.checkpoint.disk import CheckpointError

# What a resume may change and still be the same run: how long it runs (and when its rate's
# decay ends: train/resume.py keeps the run's horizon unless it is given), where and how it writes
# its files, the grid's data-parallel width and placement, the ring's wire, the schedule and its
# micro-batches (hybrid == serial: the same sums), whether the optimizer state is sharded and
# whether forwards are recomputed (neither changes a bit). Anything else (the model, the data and
# their seeds, the batch, the optimizer and its settings) makes it another job.
RESUMABLE = (
    "train.steps",
    "train.lr_decay_steps",
    "train.schedule",
    "train.microbatches",
    "train.early_grad_send",
    "train.merge_w",
    "train.shard_optimizer",
    "train.recompute",
    "grid.dp",
    "grid.order",
    "grid.device",
    "comm.*",
    "trace.*",
    "checkpoint.*",
    "model.init",  # where the run's weights started: the checkpoint holds them now
)


# what a job written before a setting existed did, where that is not the setting's default now
BEFORE_IT_EXISTED = {"train.weight_decay_on": "all"}


def job_differences(stored_toml: str, job, ignore: tuple[str, ...] = RESUMABLE) -> list[str]:
    """The settings in which a stored job (a manifest's or a trace's TOML) differs from `job`,
    as 'train.lr = 0.1 there, 0.05 here', leaving out the `ignore`d ones ('section.*' a whole
    section); a stored job that does not parse is one difference."""
    from mpihybrid.config import _toml_value, to_toml, tomllib

    try:
        theirs = tomllib.loads(stored_toml)
    except (tomllib.TOMLDecodeError, TypeError):
        return ["its stored job is not readable TOML"]
    mine = tomllib.loads(to_toml(job))
    defaults = tomllib.loads(to_toml(type(job)()))  # a setting added since: its default there
    found = []
    for section, values in mine.items():
        other = theirs.get(section, {})
        other = other if isinstance(other, dict) else {}
        for key, value in values.items():
            name = f"{section}.{key}"
            if name in ignore or f"{section}.*" in ignore or other.get(key) == value:
                continue
            if name == "train.weight_decay_on" and not (
                values.get("weight_decay") or other.get("weight_decay")
            ):
                continue  # no decay either side: what it would decay does not matter
            before = BEFORE_IT_EXISTED.get(name, defaults.get(section, {}).get(key))
            if key not in other and before == value:
                continue
            there = _toml_value(other[key]) if key in other else "(unset)"
            found.append(f"{name} = {there} there, {_toml_value(value)} here")
    return found


def check_trace_owner(path: str | os.PathLike, job) -> None:
    """Refuse (TraceError) to continue the trace at `path` when it is another run's: its
    stored job differs from `job` in more than a resume may change, or it was written with
    another checkpoint.dir (another run's checkpoints). --overwrite replaces it instead."""
    from mpihybrid.config import tomllib
    from mpihybrid.trace.read import TraceError, load

    path = Path(path)
    if not path.is_file():
        return
    config = load(path).config
    ignore = tuple(name for name in RESUMABLE if name != "checkpoint.*")
    found = job_differences(config, job, (*ignore, "checkpoint.every", "checkpoint.keep"))
    found = [line for line in found if not line.startswith("checkpoint.dir ")]
    try:
        theirs = tomllib.loads(config).get("checkpoint", {}).get("dir", "")
    except (tomllib.TOMLDecodeError, AttributeError):
        theirs = None
    mine = job.checkpoint.dir
    if not isinstance(theirs, str) or Path(theirs or ".").resolve() != Path(mine or ".").resolve():
        found.insert(0, f"checkpoint.dir = {theirs!r} there, {mine!r} here")
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise TraceError(
            f"trace {path} is another run's, not this resumed run's: {'; '.join(found[:3])}{more}"
            "; --overwrite replaces it, or choose another --trace path"
        )


def check_same_job(manifest: dict, job, path: Path, force: bool) -> None:
    """Refuse to resume another job's checkpoint (CheckpointError naming the first
    differences) unless `force`; version 1 manifests without a job pass."""
    if force or not isinstance(manifest.get("job"), str):
        return
    found = job_differences(manifest["job"], job)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise CheckpointError(
            f"checkpoint {path} is another job's: {'; '.join(found[:3])}{more}. A resume may "
            f"change only {', '.join(RESUMABLE)}; --force resumes from it anyway, or choose "
            "another checkpoint.dir"
        )
