"""A sweep's grid of runs: every schedule x M as a cell with its job, the combinations a
schedule rejects as notes, and the bounds on a sweep's size (cli/sweep.py runs them).
"""

from __future__ import annotations

import dataclasses

from mpihybrid.config import AUTO, ConfigError, Job, resolve
from mpihybrid.pipeline.schedules import SCHEDULES, ScheduleError, chunks_for, get_spec


@dataclasses.dataclass(frozen=True)
class Cell:
    schedule: str
    microbatches: int
    virtual_stages: int


def parse_schedules(text: str) -> list[str]:
    """A comma list of schedule names in the order given: 'all' stands for the nine built-ins,
    'auto' for the schedule searched for the job at each M (cli/auto.py)."""
    names = []
    for name in (n.strip() for n in text.split(",")):
        names += list(SCHEDULES) if name == "all" else [name]
    for name in names:
        if name == AUTO:
            continue
        try:
            get_spec(name)
        except ScheduleError as exc:
            raise ConfigError(f"--schedules: {exc}") from None
    if len(set(names)) != len(names):
        raise ConfigError(f"--schedules {text!r}: a schedule is named twice")
    return names


def parse_microbatches(text: str) -> list[int]:
    """'2,4,8' -> [2, 4, 8]: positive integers, no repeats."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--microbatches {text!r}: expected a comma list of positive integers, e.g. 2,4,8"
        ) from None
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ConfigError(f"--microbatches {text!r}: values must be distinct integers >= 1")
    return values


def cell_job(job: Job, cell: Cell, world_size: int, fixed_batch: bool = False) -> Job:
    """The job for one cell, no trace: same micro-batch size, global batch scaled to dp * M;
    or, with fixed_batch, the job's global batch split into M micro-batches. Raises ConfigError
    when the schedule (or, fixed_batch, the global batch) rejects the combination."""
    t, dp = job.train, job.grid.dp
    microbatch_size = job.microbatch_size
    train = dataclasses.replace(
        t,
        schedule=cell.schedule,
        microbatches=cell.microbatches,
        virtual_stages=cell.virtual_stages,
        global_batch=t.global_batch if fixed_batch else microbatch_size * dp * cell.microbatches,
    )
    trace = dataclasses.replace(job.trace, path="", overwrite=False)
    return resolve(dataclasses.replace(job, train=train, trace=trace), world_size)


MAX_RUNS = 10_000  # one sweep; more is a typo or another tool's job
MAX_STEPS = 1_000_000  # training steps over all its runs


def check_size(schedules: int, microbatches: int, repeats: int, steps: int) -> None:
    """ConfigError before any cell is built when the sweep would run more than MAX_RUNS runs or
    MAX_STEPS steps in all."""
    runs = schedules * microbatches * repeats
    if runs > MAX_RUNS:
        raise ConfigError(
            f"--schedules x --microbatches x --repeats = {schedules} x {microbatches} x "
            f"{repeats} = {runs:,} runs: more than the {MAX_RUNS:,} one sweep runs"
        )
    if runs * steps > MAX_STEPS:
        raise ConfigError(
            f"{runs:,} runs x train.steps({steps:,}) = {runs * steps:,} steps: more than the "
            f"{MAX_STEPS:,} one sweep trains; fewer runs or --set train.steps=N"
        )


def plan_text(cells: list[tuple[Cell, Job]], repeats: int) -> str:
    """The plan line printed before the first run."""
    names = list(dict.fromkeys(row_label_of(cell) for cell, _ in cells))
    ms = sorted({cell.microbatches for cell, _ in cells})
    steps = cells[0][1].train.steps
    runs = len(cells) * repeats
    return (
        f"plan: {len(cells)} cells ({', '.join(names)} x M {','.join(map(str, ms))}) x "
        f"{repeats} repeat{'s' * (repeats != 1)} = {runs} runs of {steps} steps each"
    )


def row_label_of(cell: Cell) -> str:
    return f"{cell.schedule} v={cell.virtual_stages}" if cell.virtual_stages > 1 else cell.schedule


def plan(
    job: Job,
    schedules: list[str],
    microbatches: list[int],
    virtual: int,
    world_size: int,
    *,
    fixed_batch: bool = False,
) -> tuple[list[tuple[Cell, Job]], list[str]]:
    """The legal cells with their jobs, and one note per combination a schedule rejects."""
    cells, notes = [], []
    for m in microbatches:
        for name in schedules:
            cell = Cell(name, m, 1 if name == AUTO else chunks_for(name, virtual))
            try:
                cells.append((cell, cell_job(job, cell, world_size, fixed_batch)))
            except ConfigError as exc:
                notes.append(f"skipped {name} M={m}: {exc}")
    return cells, notes
