"""A schedule as one value: its name and spec, its placement, every rank's compute lists, and
what no file holds for it (a CSV schedule's text, a searched schedule's record). It is made once
where a job is resolved (config.job.Job.schedule) or a trace is read (from_trace); the build,
the memory check, tracing, predict and analysis read it instead of turning the name into lists:

    schedule = make_schedule("zb-v", pp=4, microbatches=8, virtual_stages=2, early_grad_send=True)
    make_schedule("zb-h1", pp=2, microbatches=8, early_grad_send=True, merge_w=4)  # W in 4s
    schedule.placement, schedule.lists()[pp_rank], schedule.csv, schedule.search
"""

from __future__ import annotations

from dataclasses import dataclass

from mpihybrid.pipeline.actions import Action, ScheduleError
from mpihybrid.pipeline.csv_schedule import csv_spec, csv_text, from_trace
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.schedules import build_schedule, get_spec
from mpihybrid.pipeline.spec import ScheduleSpec


@dataclass(frozen=True, eq=False)
class Schedule:
    """Made by make_schedule, checked and dry-run; read, never changed."""

    spec: ScheduleSpec
    placement: Placement
    microbatches: int
    early_grad_send: bool  # the lists split the backwards whose gradient crosses ranks
    compute: dict[int, tuple[Action, ...]]  # pp rank -> its F, B, W in order
    csv: str | None = None  # a csv: schedule's text (the trace keeps it as schedule_csv)
    search: str | None = None  # a searched schedule's record, JSON (the trace's schedule_search)
    merge_w: int = 1  # W passes merged in groups of up to this many (actions.merge_weights)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pp(self) -> int:
        return self.placement.pp

    @property
    def virtual_stages(self) -> int:
        return self.placement.chunks

    def lists(self) -> dict[int, list[Action]]:
        """Every rank's compute actions, as lists of the caller's own."""
        return {r: list(acts) for r, acts in self.compute.items()}


def spec_of(name: str, csv: str | None = None) -> ScheduleSpec:
    """The spec of `name`: a registered schedule's, or a csv: schedule's of `csv` (its text)
    where given, else of its file. ScheduleError when there is none."""
    return csv_spec(name, csv) if csv is not None else get_spec(name)


def make_schedule(
    name: str,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    early_grad_send: bool = False,
    *,
    csv: str | None = None,
    search: str | None = None,
    merge_w: int = 1,
) -> Schedule:
    """The schedule `name` at pp ranks, M micro-batches and v chunks per rank, checked
    (schedules.check_config) and dry-run (schedules.build_schedule): ScheduleError otherwise.
    csv: a csv: schedule's text (a search's or a trace's copy; None: its file's, read now);
    search: the record of the search that found it; merge_w: a stage's W passes merged in groups
    of up to that many micro-batches (1: none)."""
    if csv is None and name.startswith("csv:"):
        csv = csv_text(name)  # read once: the lists and the trace's copy are of the same text
    spec = spec_of(name, csv)
    lists = build_schedule(spec, pp, microbatches, virtual_stages, early_grad_send, merge_w=merge_w)
    return Schedule(
        spec=spec,
        placement=spec.make_placement(pp, virtual_stages),
        microbatches=microbatches,
        early_grad_send=early_grad_send,
        compute={r: tuple(acts) for r, acts in lists.items()},
        csv=csv,
        search=search,
        merge_w=merge_w,
    )


def trace_schedule(attrs: dict) -> Schedule:
    """The schedule a trace ran, from its attributes (its name, pp, M, chunks, early sends and a
    csv: schedule's copy of its CSV, its merged W): analysed as it ran, whatever the file holds
    now."""
    name, text = from_trace(attrs)
    return make_schedule(
        name,
        int(attrs["pp"]),
        int(attrs["microbatches"]),
        int(attrs.get("virtual_stages", 1)),
        bool(attrs.get("early_grad_send", False)),
        csv=text,
        search=attrs.get("schedule_search"),
        merge_w=int(attrs.get("merge_w", 1)),
    )


__all__ = ["Schedule", "ScheduleError", "make_schedule", "spec_of", "trace_schedule"]
