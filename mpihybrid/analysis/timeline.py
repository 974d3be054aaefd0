"""Timelines of a trace: a Gantt chart PNG (matplotlib) and the ASCII step x rank grid.

    mpihybrid timeline runs/seed.h5 -o runs/seed.png --steps 2:4
    mpihybrid timeline runs/1f1b.h5 runs/gpipe.h5 -o runs/both.png   # stacked, one time axis
    mpihybrid timeline runs/seed.h5 --ascii

The PNG is WIDTH_PX wide and, per trace, HEADER_PX + ROW_PX per rank tall: one row per rank,
compute (F, B, W) in full-height bars with their micro-batch numbers, each step's critical
path (analysis/critical.py) as a red line along the top of the rows it runs through, what the
rank waited for (a receive, its gradient buckets) in a thin pale bar, so the compute stands out
even when the waits fill the step; the gradient buckets' ring and optimizer in a lane under
the row. Several traces stack on one time axis (ms since each one's first drawn step began).
"""

from __future__ import annotations

import io
import os

import numpy as np

from mpihybrid.files import write_atomic
from mpihybrid.pipeline.as_run import compute_rows, grid_as_run
from mpihybrid.pipeline.placement import Placement
from mpihybrid.trace.read import Trace
from mpihybrid.trace.recorder import COMPUTE, KIND, VOCAB

WIDTH_PX, HEADER_PX, ROW_PX, DPI = 1400, 150, 50, 100
MAX_BARS = 100_000  # more would take minutes to draw and show nothing a person can read
COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "weight": "#8172b2",
    "send": "#dd8452",
    "recv": "#bdbdbd",  # waiting: a thin pale bar, so the compute stands out
    "grad_wait": "#f2b5b7",  # the step waiting for its gradient buckets: thin and pale too
    "allreduce": "#c44e52",
    "optimizer": "#937860",
    # model.vocab_parallel's passes (docs/vocab.md)
    "vocab_embed": "#64b5cd",
    "vocab_logits": "#da8bc3",
    "vocab_grad": "#e5ae38",
    "vocab_embed_grad": "#8eba42",
}
LEGEND = {
    "forward": "F forward",
    "backward": "B backward",
    "weight": "W weight gradient",
    "send": "send",
    "recv": "waiting for a receive",
    "grad_wait": "waiting for gradients",
    "allreduce": "all-reduce (bucket lane)",
    "optimizer": "optimizer (bucket lane)",
    "step": "step",
    "vocab_embed": "E vocab embed",
    "vocab_logits": "S vocab logits",
    "vocab_grad": "T vocab grad",
    "vocab_embed_grad": "G vocab rows",
}
# the gradient buckets' rings and updates run behind the compute (comm.overlap): a thin lane
# under each rank's row, so both stay visible; waits are thin bars in the row; compute fills it
BUCKET_KINDS = ("allreduce", "optimizer")
WAIT_KINDS = ("recv", "grad_wait")


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


def _rank_labels(events: np.ndarray, placement: Placement) -> dict[int, str]:
    labels = {}
    for rank in np.unique(events["rank"]):
        rows = events[events["rank"] == rank]
        stages = rows["stage"][rows["stage"] >= 0]
        pp_rank = f"pp{placement.rank_of(int(stages[0]))} " if len(stages) else ""
        labels[int(rank)] = f"rank {rank} ({pp_rank}dp{rows['replica'][0]})"
    return labels


def _drawn_rows(trace: Trace, steps: range) -> np.ndarray:
    """The rows a chart of `steps` draws (whole steps for a trace.events = false trace);
    ValueError past MAX_BARS, naming how many there are."""
    ev = trace.events
    is_step = ev["kind"] == KIND["step"]
    in_steps = (ev["step"] >= steps.start) & (ev["step"] < steps.stop)
    rows = ev[in_steps & (~is_step if trace.has_actions else is_step)]
    if len(rows) > MAX_BARS:
        raise ValueError(
            f"{steps_text(steps)} hold {len(rows):,} events, more than the {MAX_BARS:,} bars a "
            "timeline draws: choose fewer steps (--steps A:B), or export them to Perfetto"
        )
    return rows


def render_png(traces: Trace | list[Trace], steps: range | list[range], labels=None) -> bytes:
    """The Gantt chart of `steps` of each trace as PNG bytes, stacked on one time axis (needs
    matplotlib: pip install 'mpihybrid[plot]'); labels name the panels (default: none)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "the timeline PNG needs matplotlib: pip install 'mpihybrid[plot]'"
        ) from err

    traces = traces if isinstance(traces, list) else [traces]
    spans = steps if isinstance(steps, list) else [steps] * len(traces)
    labels = labels or [None] * len(traces)
    drawn = [_drawn_rows(t, s) for t, s in zip(traces, spans, strict=True)]
    if sum(len(r) for r in drawn) > MAX_BARS:
        raise ValueError(f"the traces hold more than the {MAX_BARS:,} bars a timeline draws")
    ranks_of = [sorted(_rank_labels(t.events, Placement.from_attrs(t.attrs))) for t in traces]
    # one time axis: the longest drawn span sets it, every panel starts at its first step
    origin = [float(r["start"].min()) if len(r) else 0.0 for r in drawn]
    length = max(
        (float(r["end"].max()) - o for r, o in zip(drawn, origin, strict=True) if len(r)),
        default=1.0,
    )
    scale = 1e3  # ms on the axis
    panel_px = [HEADER_PX + ROW_PX * len(r) for r in ranks_of]
    height_in = sum(panel_px) / DPI
    fig = Figure(figsize=(WIDTH_PX / DPI, height_in), dpi=DPI)
    FigureCanvasAgg(fig)  # attaches itself: savefig renders through Agg, no pyplot state
    top_px = 0
    kinds_drawn: list[str] = []
    for trace, rows, span, label, ranks, t0, px in zip(
        traces, drawn, spans, labels, ranks_of, origin, panel_px, strict=True
    ):
        # room above each panel for its title (and the legend, on the first)
        bottom = 1 - (top_px + px - 0.55 * DPI) / (height_in * DPI)
        top = 1 - (top_px + 0.45 * DPI) / (height_in * DPI)
        top_px += px
        ax = fig.add_axes((0.12, bottom, 0.86, top - bottom))
        _panel(ax, trace, rows, span, ranks, t0=t0, length=length, scale=scale, label=label)
        colours = COLOURS if trace.has_actions else {"step": "#8c8c8c"}
        kinds_drawn += [n for n in colours if np.any(rows["kind"] == KIND[n])]
    shown = list(dict.fromkeys(kinds_drawn))
    if shown:
        colour_of = COLOURS | {"step": "#8c8c8c"}
        handles = [Patch(color=colour_of[n], label=LEGEND[n]) for n in shown]
        if any(t.has_actions for t in traces):
            handles.append(Patch(color=CRITICAL, label="critical path"))
        fig.axes[0].legend(
            handles=handles,
            loc="lower left",
            bbox_to_anchor=(0, 1.0),
            # two rows (the header's room): 5 columns, more with vocab_parallel's passes
            ncol=min(len(handles), max(5, (len(handles) + 1) // 2), (len(handles) + 1) // 2),
            fontsize=8,
            frameon=False,
        )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _panel(ax, trace: Trace, rows, steps: range, ranks, *, t0, length, scale, label) -> None:
    """One trace's rows on `ax`: bars, step lines, rank labels, the title (and its caveats)."""
    from mpihybrid.analysis.oversubscription import oversubscription

    ev = trace.events
    labels = _rank_labels(ev, Placement.from_attrs(trace.attrs))
    colours = COLOURS if trace.has_actions else {"step": "#8c8c8c"}
    # a label fits when its bar is at least ~14 px wide
    min_width = length * 14 / (0.86 * WIDTH_PX)
    y_of = {r: i for i, r in enumerate(ranks)}
    _draw_bars(ax, rows, y_of, t0, scale, min_width=min_width, colours=colours)
    if trace.has_actions:
        _draw_critical(ax, trace, steps, y_of, t0=t0, scale=scale)
    step_rows = ev[ev["kind"] == KIND["step"]]
    for step in steps:  # dashed line where each step starts on its first rank
        starts = step_rows["start"][step_rows["step"] == step]
        if len(starts):
            ax.axvline((float(starts.min()) - t0) * scale, color="black", lw=0.6, ls="--")
    ax.set_yticks(range(len(ranks)), [labels[r] for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, length * scale)
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    ax.set_xlabel(
        f"ms since {steps_text(steps)} began"
        if label is None
        else f"ms since the first drawn step began ({steps_text(steps)} of this run)",
        fontsize=8,
    )
    a = trace.attrs
    title = (
        f"{a.get('schedule', '')}, pp={a.get('pp', '?')} x dp={a.get('dp', '?')}, "
        f"M={a.get('microbatches', '?')}, codec {a.get('codec', '?')}: {steps_text(steps)}"
    )
    if label:
        title = f"{label}: {title}"
    if not trace.has_actions:
        title += " (trace.events = false: whole steps only, no F/B/W)"
    over = oversubscription(a)
    if over:
        title += (
            f"\noversubscribed: {over['ranks']} ranks on {over['cores']} cores of "
            f"{over['host']}: times measure the machine, not the schedule"
        )
    ax.set_title(title, loc="right", fontsize=9, color="#b00000" if over else "black")


CRITICAL = "#d62728"


def _draw_critical(ax, trace: Trace, steps: range, y_of: dict, *, t0: float, scale: float) -> None:
    """Each drawn step's critical path (analysis/critical.py): a red line along the top of each
    link's row, a red arrow for each message hop from the sender's row to the receiver's."""
    from mpihybrid.analysis.critical import critical_paths
    from mpihybrid.analysis.lanes import Lanes, LanesError

    try:
        lanes = Lanes.of(trace.events)
    except LanesError:
        return
    for path in critical_paths(lanes, [s for s in steps if s in set(lanes.step_numbers())]):
        x, y = [], []
        for link in path.links:
            top = y_of.get(link.rank)
            if top is None:
                continue
            a, b = (link.start - t0) * scale, (link.end - t0) * scale
            if link.kind == "hop" and link.peer in y_of:
                x += [a, b]
                y += [y_of[link.peer] - 0.42, top - 0.42]
            else:
                x += [a, b]
                y += [top - 0.42, top - 0.42]
        ax.plot(x, y, color=CRITICAL, lw=1.6, solid_capstyle="butt", zorder=5)


def _draw_bars(ax, rows: np.ndarray, y_of: dict, t0: float, scale: float, *, min_width, colours):
    """A bar per event in its kind's colour; micro-batch numbers on the F/B/W bars wide enough."""
    labelled = 0
    for name, colour in colours.items():
        sel = rows[rows["kind"] == KIND[name]]
        if not len(sel):
            continue
        y = np.array([y_of[int(r)] for r in sel["rank"]], dtype=float)
        lane, wait = name in BUCKET_KINDS, name in WAIT_KINDS
        ax.barh(
            y + 0.3 if lane else y - 0.1,
            (sel["end"] - sel["start"]) * scale,
            left=(sel["start"] - t0) * scale,
            height=0.2 if lane else 0.16 if wait else 0.6,
            color=colour,
            edgecolor="white" if lane else "none",  # bucket after bucket stays readable
            linewidth=0.4,
        )
        if KIND[name] not in COMPUTE and KIND[name] not in VOCAB:
            continue
        for e, yy in zip(sel, y, strict=True):
            if e["end"] - e["start"] >= min_width and labelled < 5000:
                labelled += 1
                ax.text(
                    (float(e["start"] + e["end"]) / 2 - t0) * scale,
                    yy - 0.1,
                    str(int(e["microbatch"])),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )


def write_png(
    trace: Trace | list[Trace],
    path: str | os.PathLike,
    steps: range | list[range],
    overwrite: bool = False,
    labels: list[str] | None = None,
) -> None:
    """Render the Gantt chart of `steps` (of each trace, stacked) and write it atomically."""
    write_atomic(path, render_png(trace, steps, labels), overwrite)


def ascii_timeline(trace: Trace, step: int, replica: int = 0) -> str:
    """The step x rank grid of what replica `replica` ran in `step`: each pp rank's F/B/W in
    the order they started, drawn by simulate.render_grid (one grid step per action)."""
    placement = Placement.from_attrs(trace.attrs)
    if not trace.has_actions:
        raise ValueError(
            "the trace holds one row per rank and step (trace.events = false), not the order of "
            "F/B/W: draw the steps with `timeline -o OUT.png`, or train with trace.events = true"
        )
    rows = compute_rows(trace.events, step, replica)
    if not len(rows):
        raise ValueError(f"no F/B/W events for step {step + 1}, replica {replica}")
    world = {placement.rank_of(int(e["stage"])): int(e["rank"]) for e in rows}
    ranks = ", ".join(f"{p} = world {world[p]}" for p in sorted(world))
    head = f"step {step + 1}, replica {replica}: F/B/W in the order they started (pp rank {ranks})"
    return head + "\n" + grid_as_run(trace.events, placement, step, replica)
