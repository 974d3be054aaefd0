"""torch.distributed.pipelining's CSV schedules, both ways, in its compute-only form.

    mpihybrid schedule show --schedule zb-v --pp 2 -m 4 --csv zbv.csv     # write
    mpihybrid schedule show --schedule csv:zbv.csv --pp 2 -m 4             # read
    mpiexec -n 2 mpihybrid train jobs/gpt_bench.toml --set train.schedule=csv:zbv.csv

One row per pp rank, one cell per action as torch's `_dump_csv` writes them: `{stage}{kind}{mb}`
with kinds F (forward), I (backward for inputs), W (backward for weights), B (full backward);
an empty cell is idle; `(0F1;3B0)OVERLAP_F_B` is a forward overlapped with a backward, which runs
here as its first action then its second. `0W4+5+6` is ours, not torch's: a merged W, one weight-
gradient pass over micro-batches 4, 5 and 6 (train.merge_w). The placement comes from the rows
(each stage on the rank whose row holds it); the messages come from our lowering
(schedules.lower). torch's FSDP and gradient-reduction cells (UNSHARD, RESHARD, REDUCE_GRAD) have
nothing to run here and are skipped.
Writing puts each action in the column of its step in a unit-cost simulation (F = B = W = 1).
"""

from __future__ import annotations

import csv
import functools
import io
import os
import re

from mpihybrid.inputs import InputFileError, MiB, read_text
from mpihybrid.pipeline.actions import Action, ScheduleError, split_backwards
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.spec import ScheduleSpec

MAX_CSV_BYTES = 16 * MiB  # pp = 64 ranks of 3 * 1024 actions take under 2 MiB
MAX_CELL_CHARS = 64  # the longest action, (65535F65535;65535B65535)OVERLAP_F_B, is 39
MAX_INDEX = 65535  # a stage or micro-batch index (a trace holds at most 2^16 micro-batches)
_CELL = re.compile(r"(\d+)([A-Z_]+?)(\d*)((?:\+\d+)*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_SKIPPED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_COMPUTE = {"F": "F", "I": "B", "B": "B", "W": "W"}  # torch's kind -> ours (I: a split B)


def _parse_cell(text: str, where: str) -> list[tuple[int, str, int, tuple[int, ...]]]:
    """(stage, torch kind, mb, a merged W's further mbs) of the actions one cell holds, in the
    order they run."""
    text = text.strip()
    if not text:
        return []
    if len(text) > MAX_CELL_CHARS + 6 * text.count("+"):  # a merged W: +65535 a micro-batch
        raise ScheduleError(
            f"{where}: a cell of {len(text):,} characters (an action takes at most "
            f"{MAX_CELL_CHARS}): {text[:24]!r}..."
        )
    pair = _OVERLAP.fullmatch(text)
    if pair:
        parts = [p.strip() for p in pair.group(1).split(";")]
        if len(parts) != 2:
            raise ScheduleError(f"{where}: {text!r}: an OVERLAP_F_B cell holds two actions")
        return [a for p in parts for a in _parse_cell(p, where)]
    match = _CELL.fullmatch(text)
    if match is None:
        raise ScheduleError(
            f"{where}: {text!r} is not an action like 0F0, 1I2, 1W2, 0B3, (0F1;3B0)OVERLAP_F_B "
            "or 1W2+3"
        )
    stage, kind, mb = match.group(1), match.group(2), match.group(3)
    more = match.group(4).split("+")[1:]
    if kind in _SKIPPED:
        return []
    if more and kind != "W":
        raise ScheduleError(f"{where}: {text!r}: only a W merges micro-batches (1W2+3)")
    if len(more) > MAX_INDEX:
        raise ScheduleError(f"{where}: {text!r}: more micro-batches than {MAX_INDEX}")
    for index in (stage, mb, *more):
        if len(index) > 5 or int(index or 0) > MAX_INDEX:  # int() of 10^5 digits: an error
            raise ScheduleError(f"{where}: {text!r}: an index above {MAX_INDEX}")
    if kind not in _COMPUTE or not mb:
        raise ScheduleError(
            f"{where}: {text!r}: a compute-only schedule holds F, I, W and B actions"
            + (" (messages come from our lowering)" if kind.startswith(("SEND", "RECV")) else "")
        )
    return [(int(stage), kind, int(mb), tuple(int(m) for m in more))]


def parse_csv(text: str, source: str) -> tuple[dict[int, list[Action]], Placement, int]:
    """Compute lists, placement and micro-batch count of a CSV schedule; ScheduleError naming
    the row (rank) and the cell of the first problem."""
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as exc:  # a cell past csv's field limit (128 KiB), a NUL byte
        raise ScheduleError(f"{source}: not a CSV schedule ({exc})") from None
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()  # a trailing blank line
    if not rows:
        raise ScheduleError(f"{source}: no rows (one row of actions per pp rank)")
    actions: dict[int, list[Action]] = {}
    kinds: dict[tuple[int, int], tuple[str, int, int]] = {}  # (stage, mb) -> torch B kind, at
    where_of: dict[Action, str] = {}
    for rank, row in enumerate(rows):
        actions[rank] = []
        for col, cell in enumerate(row):
            where = f"{source} row {rank + 1} (rank {rank}) cell {col + 1}"
            for stage, kind, mb, more in _parse_cell(cell, where):
                a = Action(stage, _COMPUTE[kind], mb, merged=more)
                if kind in ("I", "B"):
                    kinds[(stage, mb)] = (kind, rank, col)
                actions[rank].append(a)
                where_of.setdefault(a, where)
    try:
        placement = Placement.of_actions(actions)
    except ValueError as exc:
        raise ScheduleError(f"{source}: {exc}") from None
    weights = split_backwards(actions)
    for (stage, mb), (kind, rank, col) in sorted(kinds.items()):
        where = f"{source} row {rank + 1} (rank {rank}) cell {col + 1}"
        if kind == "I" and (stage, mb) not in weights:
            raise ScheduleError(
                f"{where}: {stage}I{mb} has no {stage}W{mb} (I is the input "
                "gradient only; B is the whole backward)"
            )
        if kind == "B" and (stage, mb) in weights:
            raise ScheduleError(
                f"{where}: {stage}B{mb} is a whole backward, yet {stage}W{mb} "
                "runs too (split backwards are I then W)"
            )
    m = 1 + max((a.microbatch for acts in actions.values() for a in acts), default=-1)
    return actions, placement, m


@functools.lru_cache(maxsize=16)
def _file_text(path: str, stamp: tuple[int, int]) -> str:
    try:  # a FIFO or a device: refused before it is opened (on every rank alike)
        return read_text(path, what="CSV schedule", limit=MAX_CSV_BYTES)
    except InputFileError as exc:
        raise ScheduleError(str(exc)) from None


def csv_text(name: str) -> str:
    """The CSV text of the file schedule `name` (csv:PATH) names (cached while it is unchanged)."""
    path = name[len("csv:") :]
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ScheduleError(f"csv:{path}: cannot read it ({exc.strerror})") from None
    return _file_text(path, (st.st_mtime_ns, st.st_size))


def from_trace(attrs: dict) -> tuple[str, str | None]:
    """A trace's schedule: (its name, the CSV text the trace carries for a csv: schedule, or
    None), so a csv: schedule is analysed as it ran though the file be gone or changed (an
    older trace without the copy: None, the file as it is now)."""
    name, text = str(attrs["schedule"]), attrs.get("schedule_csv")
    return name, (str(text) if name.startswith("csv:") and text is not None else None)


@functools.lru_cache(maxsize=16)
def _parsed(text: str, source: str) -> tuple[dict[int, list[Action]], Placement, int]:
    return parse_csv(text, source)


def read_csv(name: str, text: str | None = None) -> tuple[dict[int, list[Action]], Placement, int]:
    """The compute lists, placement and micro-batch count of `name` (csv:PATH, or a bare PATH):
    of `text` where given (a trace's or a search's copy), else of the file."""
    name = name if name.startswith("csv:") else f"csv:{name}"
    actions, placement, m = _parsed(csv_text(name) if text is None else text, name)
    return {r: list(acts) for r, acts in actions.items()}, placement, m


def csv_spec(name: str, text: str | None = None) -> ScheduleSpec:
    """The ScheduleSpec of `csv:PATH` (of `text` where given: read_csv): the lists, the rows'
    placement, the M; no closed bubble formula (simulate.bubble_formula simulates it)."""
    actions, placement, m_file = read_csv(name, text)

    def check(pp: int, m: int, v: int) -> None:
        if pp != placement.pp:
            raise ScheduleError(f"{name} has {placement.pp} rows (pp rank each), not pp={pp}")
        if m != m_file:
            raise ScheduleError(f"{name} schedules {m_file} micro-batches, not {m}")

    return ScheduleSpec(
        name=name,
        build=lambda pp, m, v: {r: list(acts) for r, acts in actions.items()},
        placement="rows",
        chunks=placement.chunks,
        min_microbatches=lambda pp, v: 1,
        bubble_text="simulated (CSV)",
        bubble=None,
        splits_backward=bool(split_backwards(actions)),
        memory_text="-",
        placement_of=lambda pp, v: placement,
        check=check,
    )


def dump_csv(actions: dict[int, list[Action]], start: dict[Action, float]) -> str:
    """torch's compute-only CSV of a (valid) schedule: a row per rank, a column per unit-cost
    step (`start`: simulate.simulate's with simulate.unit_costs, as `schedule show` draws it; a
    whole B takes two steps where W is split elsewhere), a split backward as I, a whole one as B."""
    split = split_backwards(actions)
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in sorted(actions):
        row: list[str] = []
        for a in actions[rank]:
            column = int(start[a])
            row += [""] * (column - len(row))
            kind = "I" if a.kind == "B" and (a.stage, a.microbatch) in split else a.kind
            row.append(f"{a.stage}{kind}{a.microbatch}" + "".join(f"+{m}" for m in a.merged))
        writer.writerow(row)
    return out.getvalue()
