"""A job: TOML file -> one frozen dataclass per section, `--set` overrides, validation.

Command line beats file beats defaults:

    mpiexec -n 12 mpihybrid train jobs/seed_k3_d4.toml --set train.steps=20 --set comm.codec=fp32

Validation needs only the job and the world size, so every rank reaches the same verdict before
any message is sent; errors show the whole formula (`pp(4) * dp(3) = 12 != world size 8`).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from mpihybrid.config.job import (
    AUTO,
    DECAY_ON,
    GRID_ORDERS,
    OPTIMIZERS,
    PARAM_CODECS,
    RECOMPUTE,
    SECTION_TYPES,
    SECTIONS,
    UNION_KEYS,
    WARM,
    CheckpointConfig,
    CommConfig,
    ConfigError,
    DataConfig,
    GridConfig,
    Job,
    ModelConfig,
    Searched,
    TraceConfig,
    TrainConfig,
)
from mpihybrid.config.rules import validate
from mpihybrid.inputs import MAX_TOML_BYTES, InputFileError, read_text
from mpihybrid.pipeline.actions import ScheduleError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [  # the settings (config/job.py) are read from here as from their own module
    "AUTO",
    "DECAY_ON",
    "GRID_ORDERS",
    "OPTIMIZERS",
    "PARAM_CODECS",
    "RECOMPUTE",
    "SECTIONS",
    "WARM",
    "CheckpointConfig",
    "CommConfig",
    "ConfigError",
    "DataConfig",
    "GridConfig",
    "Job",
    "ModelConfig",
    "Searched",
    "TraceConfig",
    "TrainConfig",
    "build_job",
    "load_job",
    "load_table",
    "parse_override",
    "resolve",
    "to_toml",
    "tomllib",
]


SAMPLES_PER_REPLICA = 32  # the embedded job's batch: about this many samples per replica


def default_job_table(world_size: int) -> dict:
    """The embedded job, beneath every job file (an empty file and no file are the same job):
    runs on any world size (pp=2 when it is even, else pp=1; dp is left to -1, so --set
    grid.pp alone works). Its global batch is chosen by load_job once dp is known."""
    return {
        "grid": {"pp": 2 if world_size % 2 == 0 else 1},
        "train": {"steps": 30, "microbatches": 4},
    }


def _merge(base: dict, top: dict) -> dict:
    """Two job tables, key by key within each section; `top` wins."""
    merged = {section: dict(values) for section, values in base.items()}
    for section, values in top.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = values
    return merged


def parse_override(text: str) -> tuple[str, str, Any]:
    """'train.steps=20' -> ('train', 'steps', 20); a value that is not TOML is a bare string."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.steps=20")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError as exc:
        # a bare word (int8, runs/x) is a string; one that opens a TOML string, list or table
        # and is not valid TOML is refused (kept as text, a quote would end up in a path)
        if raw.strip()[:1] in ('"', "'", "[", "{"):
            raise ConfigError(f"--set {text!r}: the value is not valid TOML ({exc})") from None
        value = raw.strip()
    return section, name, value


def load_table(path: str | Path | None) -> dict:
    if path is None:
        return {}
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"job file {str(p)!r} is a directory, not a TOML file")
    if not p.exists():
        raise ConfigError(f"job file {str(p)!r} does not exist")
    try:  # a FIFO or a device: refused before it is opened (every rank alike)
        text = read_text(p, what="job file", limit=MAX_TOML_BYTES)
    except InputFileError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"job file {str(p)!r} is not valid TOML: {exc}") from None


def _check_type(where: str, value: Any, default: Any) -> Any:
    want = type(default)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (want is bool) or not isinstance(value, want):
        raise ConfigError(
            f"{where} = {value!r}: expected {want.__name__}, got {type(value).__name__}"
        )
    return value


def build_job(table: dict, overrides: list[str] = ()) -> Job:
    """Merge a parsed TOML table and `--set` overrides into a Job (types checked, not validated)."""
    merged: dict[str, dict] = {}
    for section, values in table.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of key = value")
        merged[section] = dict(values)
    for text in overrides:
        section, name, value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError(
                f"--set {text!r}: unknown section {section!r}; known: {', '.join(SECTIONS)}"
            )
        merged.setdefault(section, {})[name] = value
    parts = {}
    for section, factory in SECTION_TYPES.items():
        defaults = factory()
        known = {f.name: getattr(defaults, f.name) for f in fields(defaults)}
        values = merged.get(section, {})
        for name, value in values.items():
            if name not in known:
                raise ConfigError(
                    f"unknown key {section}.{name}; [{section}] has: {', '.join(known)}"
                )
            if isinstance(value, UNION_KEYS.get((section, name), ())):
                continue
            values[name] = _check_type(f"{section}.{name}", value, known[name])
        parts[section] = dataclasses.replace(defaults, **values)
    return Job(**parts)


def resolve(job: Job, world_size: int) -> Job:
    """Fill dp = -1 from the world size, then validate everything against it."""
    g = job.grid
    if g.pp < 1:
        raise ConfigError(f"grid.pp = {g.pp}: must be >= 1")
    dp = g.dp
    if dp == -1:
        if world_size % g.pp:
            raise ConfigError(f"grid.dp = -1 needs world size {world_size} divisible by pp({g.pp})")
        dp = world_size // g.pp
    if dp < 1:
        raise ConfigError(f"grid.dp = {dp}: must be >= 1 (or -1 for world size // pp)")
    if g.pp * dp != world_size:
        raise ConfigError(f"pp({g.pp}) * dp({dp}) = {g.pp * dp} != world size {world_size}")
    job = dataclasses.replace(job, grid=dataclasses.replace(g, dp=dp))
    job = _schedule_chunks(job)
    validate(job)
    return job


def _schedule_chunks(job: Job) -> Job:
    """A schedule whose spec fixes its chunks per rank (zb-v, dualpipev: 2; a CSV: its rows')
    sets train.virtual_stages when the job leaves it at 1; any other value is checked later."""
    t = job.train
    if t.schedule == AUTO:  # the search decides (cli/auto.py), then the job is resolved again
        return job
    try:
        fixed = job.schedule_spec.chunks
    except ScheduleError as exc:
        raise ConfigError(f"train.schedule = {t.schedule!r}: {exc}") from None
    if fixed > 1 and t.virtual_stages == 1:
        return dataclasses.replace(job, train=dataclasses.replace(t, virtual_stages=fixed))
    return job


def to_toml(job: Job) -> str:
    """The resolved job as TOML text (stored in traces; loads back with build_job)."""
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        part = getattr(job, section)
        for f in fields(part):
            lines.append(f"{f.name} = {_toml_value(getattr(part, f.name))}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def load_job(path: str | Path | None, overrides: list[str], world_size: int) -> Job:
    """The embedded job, then the job file, then the overrides, resolved for `world_size`.

    train.global_batch given nowhere: about SAMPLES_PER_REPLICA samples per replica, rounded
    to a multiple of dp x microbatches (so the embedded job runs on any world size)."""
    table = _merge(default_job_table(world_size), load_table(path))
    job = build_job(table, overrides)
    given = "global_batch" in table.get("train", {}) or any(
        parse_override(o)[:2] == ("train", "global_batch") for o in overrides
    )
    g, t = job.grid, job.train
    if not given and g.pp >= 1 and t.microbatches >= 1:
        dp = g.dp if g.dp != -1 else max(world_size // g.pp, 1)
        per_replica = t.microbatches * max(1, round(SAMPLES_PER_REPLICA / t.microbatches))
        job = dataclasses.replace(
            job, train=dataclasses.replace(t, global_batch=per_replica * max(dp, 1))
        )
    return resolve(job, world_size)
