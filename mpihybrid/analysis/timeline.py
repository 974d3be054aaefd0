"""Timelines of a trace: a Gantt chart PNG (matplotlib) and the ASCII step x rank grid.

    mpihybrid timeline runs/seed.h5 -o runs/seed.png --steps 2:4
    mpihybrid timeline runs/seed.h5 --ascii

The PNG is WIDTH_PX wide and HEADER_PX + ROW_PX per rank tall: one row per rank, a colour per
event kind, micro-batch numbers on the F/B/W bars wide enough to hold them.
"""

from __future__ import annotations

import io
import os

import numpy as np

from mpihybrid.files import write_atomic
from mpihybrid.pipeline.as_run import compute_rows, grid_as_run
from mpihybrid.pipeline.schedules import stage_rank
from mpihybrid.trace.file import Trace
from mpihybrid.trace.recorder import COMPUTE, KIND

WIDTH_PX, HEADER_PX, ROW_PX, DPI = 1400, 150, 50, 100
COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "weight": "#8172b2",
    "send": "#dd8452",
    "recv": "#d0d0d0",  # waiting: light, so the compute stands out
    "allreduce": "#c44e52",
    "optimizer": "#937860",
    "grad_wait": "#f2b5b7",  # the step waiting for its gradient buckets: pale, like recv
}
# the gradient buckets' rings and updates run behind the compute (comm.overlap): a thin lane
# under each rank's row, so both stay visible; everything else fills the row
BUCKET_KINDS = ("allreduce", "optimizer")


def step_range(trace: Trace, spec: str | int | None) -> range:
    """The steps chosen by `spec` (timeline and export --steps), as the trace numbers them (from
    0), from the numbers users see (from 1, as the progress line and analyze count): None = the
    last step, N = step N, "A:B" = steps A to B, both included, like trace.first_step/last_step
    (either may be left out); ValueError naming the steps the trace holds when none is chosen."""
    steps = trace.events["step"][trace.events["step"] >= 0] + 1
    if not len(steps):
        raise ValueError("the trace holds no steps")
    first, last = int(steps.min()), int(steps.max())
    if spec is None:
        chosen = range(last, last + 1)
    elif isinstance(spec, int):
        chosen = range(spec, spec + 1)
    else:
        text = spec.strip()
        try:
            if ":" in text:
                lo, hi = text.split(":", 1)
                chosen = range(int(lo) if lo else first, (int(hi) if hi else last) + 1)
            else:
                chosen = range(int(text), int(text) + 1)
        except ValueError:
            raise ValueError(f"steps {spec!r}: expected N or A:B (A to B), e.g. 2:4") from None
    kept = range(max(chosen.start, first) - 1, min(chosen.stop, last + 1) - 1)
    if not len(kept):
        raise ValueError(f"steps {spec}: the trace holds steps {first}..{last}")
    return kept


def steps_text(steps: range) -> str:
    """'step 3' or 'steps 3-5', counted from 1 (a range of the trace's steps, from 0)."""
    if len(steps) == 1:
        return f"step {steps.start + 1}"
    return f"steps {steps.start + 1}-{steps[-1] + 1}"


def _rank_labels(events: np.ndarray, pp: int) -> dict[int, str]:
    labels = {}
    for rank in np.unique(events["rank"]):
        rows = events[events["rank"] == rank]
        stages = rows["stage"][rows["stage"] >= 0]
        pp_rank = f"pp{stage_rank(int(stages[0]), pp)} " if len(stages) else ""
        labels[int(rank)] = f"rank {rank} ({pp_rank}dp{rows['replica'][0]})"
    return labels


def render_png(trace: Trace, steps: range) -> bytes:
    """The Gantt chart of `steps` as PNG bytes (needs matplotlib: pip install 'mpihybrid[plot]')."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "the timeline PNG needs matplotlib: pip install 'mpihybrid[plot]'"
        ) from err

    ev = trace.events
    pp = int(trace.attrs.get("pp", 1))
    labels = _rank_labels(ev, pp)
    ranks = sorted(labels)
    # a trace.events = false trace has only whole steps: draw those, and say so
    only_steps = not trace.has_actions
    colours = {"step": "#8c8c8c"} if only_steps else COLOURS
    is_step = ev["kind"] == KIND["step"]
    rows = ev[np.isin(ev["step"], list(steps)) & (is_step if only_steps else ~is_step)]
    t0 = float(rows["start"].min()) if len(rows) else 0.0
    t1 = float(rows["end"].max()) if len(rows) else 1.0
    scale = 1e3  # ms on the axis

    height_in = (HEADER_PX + ROW_PX * len(ranks)) / DPI
    fig = Figure(figsize=(WIDTH_PX / DPI, height_in), dpi=DPI)
    FigureCanvasAgg(fig)  # attaches itself: savefig renders through Agg, no pyplot state
    bottom, top = 0.55 / height_in, 1 - 0.45 / height_in  # room for the axis and the legend
    ax = fig.add_axes((0.12, bottom, 0.86, top - bottom))
    # a label fits when its bar is at least ~14 px wide
    min_width = (t1 - t0) * 14 / (0.86 * WIDTH_PX)
    y_of = {r: i for i, r in enumerate(ranks)}
    _draw_bars(ax, rows, y_of, t0, scale, min_width, colours)
    for step in steps:  # dashed line where each step starts on its first rank
        starts = ev["start"][(ev["step"] == step) & (ev["kind"] == KIND["step"])]
        if len(starts):
            ax.axvline((float(starts.min()) - t0) * scale, color="black", lw=0.6, ls="--")
    ax.set_yticks(range(len(ranks)), [labels[r] for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) * scale)
    ax.set_xlabel(f"ms since step {steps.start + 1} began", fontsize=8)
    shown = [n for n in colours if np.any(rows["kind"] == KIND[n])]
    if shown:
        ax.legend(
            handles=[Patch(color=colours[n], label=n) for n in shown],
            loc="lower left",
            bbox_to_anchor=(0, 1.0),
            ncol=len(shown),
            fontsize=8,
            frameon=False,
        )
    a = trace.attrs
    title = (
        f"{a.get('schedule', '')}, pp={a.get('pp', '?')} x dp={a.get('dp', '?')}, "
        f"M={a.get('microbatches', '?')}, codec {a.get('codec', '?')}: {steps_text(steps)}"
    )
    if only_steps:
        title += " (trace.events = false: whole steps only, no F/B/W)"
    ax.set_title(title, loc="right", fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _draw_bars(ax, rows: np.ndarray, y_of: dict, t0: float, scale: float, min_width, colours):
    """A bar per event in its kind's colour; micro-batch numbers on the F/B/W bars wide enough."""
    for name, colour in colours.items():
        sel = rows[rows["kind"] == KIND[name]]
        if not len(sel):
            continue
        y = np.array([y_of[int(r)] for r in sel["rank"]], dtype=float)
        lane = name in BUCKET_KINDS
        ax.barh(
            y + 0.3 if lane else y - 0.1,
            (sel["end"] - sel["start"]) * scale,
            left=(sel["start"] - t0) * scale,
            height=0.2 if lane else 0.6,
            color=colour,
            edgecolor="white" if lane else "none",  # bucket after bucket stays readable
            linewidth=0.4,
        )
        if KIND[name] not in COMPUTE:
            continue
        for e, yy in zip(sel, y, strict=True):
            if e["end"] - e["start"] >= min_width:
                ax.text(
                    (float(e["start"] + e["end"]) / 2 - t0) * scale,
                    yy - 0.1,
                    str(int(e["microbatch"])),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )


def write_png(trace: Trace, path: str | os.PathLike, steps: range, overwrite: bool = False) -> None:
    """Render the Gantt chart of `steps` and write it atomically to `path`."""
    write_atomic(path, render_png(trace, steps), overwrite)


def ascii_timeline(trace: Trace, step: int, replica: int = 0) -> str:
    """The step x rank grid of what replica `replica` ran in `step`: each pp rank's F/B/W in
    the order they started, drawn by simulate.render_grid (one grid step per action)."""
    pp = int(trace.attrs.get("pp", 1))
    v = int(trace.attrs.get("virtual_stages", 1))
    if not trace.has_actions:
        raise ValueError(
            "the trace holds one row per rank and step (trace.events = false), not the order of "
            "F/B/W: draw the steps with `timeline -o OUT.png`, or train with trace.events = true"
        )
    rows = compute_rows(trace.events, step, replica)
    if not len(rows):
        raise ValueError(f"no F/B/W events for step {step + 1}, replica {replica}")
    world = {stage_rank(int(e["stage"]), pp, v): int(e["rank"]) for e in rows}
    ranks = ", ".join(f"{p} = world {world[p]}" for p in sorted(world))
    head = f"step {step + 1}, replica {replica}: F/B/W in the order they started (pp rank {ranks})"
    return head + "\n" + grid_as_run(trace.events, pp, v, step, replica)
