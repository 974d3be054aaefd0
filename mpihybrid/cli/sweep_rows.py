"""A sweep's rows: what one run measured (a CSV row), the speedups over GPipe, the medians over
repeats, the table and the CSV (rank 0; cli/sweep.py runs them, cli/sweep_plots.py draws them).
"""

from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path

import numpy as np

from mpihybrid.cli.sweep_plan import Cell
from mpihybrid.config import ConfigError, Job
from mpihybrid.files import write_atomic
from mpihybrid.nn.kinds import model_kind
from mpihybrid.pipeline.liveness import replay_rows
from mpihybrid.pipeline.schedules import SCHEDULES
from mpihybrid.trace.recorder import step_times
from mpihybrid.units import table as text_table

COLUMNS = (
    "schedule",
    "virtual_stages",
    "microbatches",
    "repeat",
    "pp",
    "dp",
    "global_batch",
    "microbatch_size",
    "measured_steps",
    "step_ms",
    "samples_per_s",
    "tokens_per_s",  # token data (gpt): samples_per_s x data.seq_len; empty otherwise
    "bubble_measured",
    "bubble_predicted",
    "bubble_textbook",
    "peak_inflight",  # most micro-batches alive on one stage, measured
    "peak_inflight_predicted",  # the same, from the action lists
    "peak_inflight_per_stage",  # measured, stage 0;1;...
    "peak_inflight_predicted_per_stage",
    "peak_activation_mib",  # most activation bytes alive on one rank, measured
    # most activations alive on one rank, in micro-batches of the rank's share of the model (a
    # chunk's micro-batch counts 1/chunks): measured (the last step as run), from the action
    # lists, and the zero-bubble paper's memory column for the schedule
    "peak_rank",
    "peak_rank_predicted",
    "memory_paper",
    "speedup_vs_gpipe",  # GPipe's median step time at this M / this run's step time
    "forward_ms",  # measured mean per action, averaged over stages
    "backward_ms",  # input gradient only where the schedule splits off W
    "weight_ms",
    "message_us",  # measured hop latency the prediction adds to every cross-rank dependency
    "final_loss",
)


def peak_activation_bytes(events: np.ndarray, step: int) -> int:
    """Most activation bytes alive at once on one rank in `step` (replica 0): an F holds what its
    cache keeps (the event's bytes) while it is alive (liveness.replay_rows)."""
    rows = events[(events["step"] == step) & (events["replica"] == 0)]
    ranks = np.unique(rows["rank"])
    return max((replay_rows(rows[rows["rank"] == r]).peak_total_bytes for r in ranks), default=0)


def measure(summary, job: Job, cell: Cell, repeat: int, warmup_steps: int) -> dict:
    """One CSV row from a finished run's Summary."""
    from mpihybrid.analysis.metrics import bubble_summary
    from mpihybrid.pipeline.as_run import actions_as_run
    from mpihybrid.pipeline.simulate import bubble_formula, peak_inflight, peak_per_rank

    g, t = job.grid, job.train
    # what ran: an auto cell runs the schedule searched for it (csv:auto@HASH, its chunks)
    m, v = cell.microbatches, t.virtual_stages
    measured = [t for s, t in step_times(summary.events).items() if s >= warmup_steps]
    step_s = statistics.median(measured)
    schedule = job.schedule  # made when the cell's job was resolved
    bubble = bubble_summary(summary.events, schedule, skip_steps=warmup_steps)
    costs = bubble["costs"]
    placement, actions = schedule.placement, schedule.lists()
    predicted_peaks = peak_inflight(actions, placement)
    measured_peaks = [summary.peak_inflight[s] for s in sorted(summary.peak_inflight)]
    return {
        "schedule": cell.schedule,
        "virtual_stages": v,
        "microbatches": m,
        "repeat": repeat,
        "pp": g.pp,
        "dp": g.dp,
        "global_batch": t.global_batch,
        "microbatch_size": job.microbatch_size,
        "measured_steps": t.steps - warmup_steps,
        "step_ms": 1e3 * step_s,
        "samples_per_s": t.global_batch / step_s,
        "tokens_per_s": (
            t.global_batch * job.tokens_per_sample / step_s
            if model_kind(job.model.kind).tokens
            else None
        ),
        "bubble_measured": float(bubble["measured"]),
        "bubble_predicted": float(bubble["predicted"]),
        "bubble_textbook": bubble_formula(schedule.spec, g.pp, m, v),
        "peak_inflight": max(measured_peaks),
        "peak_inflight_predicted": max(predicted_peaks),
        "peak_inflight_per_stage": ";".join(map(str, measured_peaks)),
        "peak_inflight_predicted_per_stage": ";".join(map(str, predicted_peaks)),
        "peak_activation_mib": peak_activation_bytes(summary.events, t.steps - 1) / 2**20,
        "peak_rank": max(
            peak_per_rank(actions_as_run(summary.events, placement, t.steps - 1), placement)
        ),
        "peak_rank_predicted": max(peak_per_rank(actions, placement)),
        "memory_paper": schedule.spec.memory_text,
        "speedup_vs_gpipe": None,
        "forward_ms": 1e3 * float(np.mean(costs["forward"])),
        "backward_ms": 1e3 * float(np.mean(costs["backward"])),
        "weight_ms": 1e3 * float(np.mean(costs["weight"])),
        "message_us": 1e6 * costs["send"],
        "final_loss": summary.losses[-1],
    }


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_gpipe = GPipe's median step time at the same M / the row's step time."""
    for m in {r["microbatches"] for r in rows}:
        gpipe = [r["step_ms"] for r in rows if r["microbatches"] == m and r["schedule"] == "gpipe"]
        if gpipe:
            reference = statistics.median(gpipe)
            for r in rows:
                if r["microbatches"] == m:
                    r["speedup_vs_gpipe"] = reference / r["step_ms"]


def row_label(row: dict) -> str:
    v = row["virtual_stages"]
    return f"{row['schedule']} v={v}" if v > 1 else row["schedule"]


def medians(rows: list[dict]) -> list[dict]:
    """One row per (schedule, M): timings and bubbles as medians over the repeats, peaks as
    maxima."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["schedule"], r["microbatches"]), []).append(r)
    out = []
    for _, group in sorted(groups.items(), key=lambda kv: (kv[0][1], schedule_order(kv[0][0]))):
        med = dict(group[0], repeats=len(group), label=row_label(group[0]))
        for key in ("step_ms", "samples_per_s", "bubble_measured", "bubble_predicted"):
            med[key] = statistics.median(r[key] for r in group)
        tokens = [r["tokens_per_s"] for r in group if r.get("tokens_per_s") is not None]
        med["tokens_per_s"] = statistics.median(tokens) if tokens else None
        med["peak_inflight"] = max(r["peak_inflight"] for r in group)
        med["peak_activation_mib"] = max(r["peak_activation_mib"] for r in group)
        speedups = [r["speedup_vs_gpipe"] for r in group if r["speedup_vs_gpipe"] is not None]
        med["speedup_vs_gpipe"] = statistics.median(speedups) if speedups else None
        # the spread over repeats, drawn around the medians: (min, max) per measured key
        for key in ("samples_per_s", "bubble_measured", "peak_activation_mib"):
            values = [r[key] for r in group]
            med[f"{key}_range"] = (min(values), max(values))
        med["speedup_vs_gpipe_range"] = (min(speedups), max(speedups)) if speedups else None
        out.append(med)
    return out


def schedule_order(name: str) -> int:
    return SCHEDULES.index(name) if name in SCHEDULES else len(SCHEDULES)  # csv: last


def format_table(rows: list[dict]) -> str:
    """Medians over repeats, one line per (M, schedule)."""
    summary = medians(rows)
    tokens = any(r.get("tokens_per_s") is not None for r in summary)  # token data: tokens/s
    header = ("M", "schedule", "step ms", "tokens/s" if tokens else "samples/s", "bubble")
    header += ("predicted", "textbook", "error", "peak", "pred", "act MiB", "vs gpipe")
    table = [header]
    for r in summary:
        predicted = r["bubble_predicted"]
        error = (r["bubble_measured"] - predicted) / predicted if predicted > 0 else None
        speedup = r["speedup_vs_gpipe"]
        table.append(
            (
                str(r["microbatches"]),
                row_label(r),
                f"{r['step_ms']:.1f}",
                f"{r['tokens_per_s'] if tokens else r['samples_per_s']:,.0f}",
                f"{r['bubble_measured']:.3f}",
                f"{r['bubble_predicted']:.3f}",
                f"{r['bubble_textbook']:.3f}",
                "-" if error is None else f"{100 * error:+.0f}%",
                str(r["peak_inflight"]),
                str(r["peak_inflight_predicted"]),
                f"{r['peak_activation_mib']:.1f}",
                "-" if speedup is None else f"{speedup:.2f}x",
            )
        )
    return "\n".join(text_table(list(header), [list(r) for r in table[1:]], labels=0))


def check_output(path: Path, overwrite: bool) -> None:
    """Raise ConfigError now for an output the sweep could not write after all its runs."""
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise ConfigError(f"cannot write {path}: it is a directory")
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} already exists; choose another path or pass --overwrite")


def write_csv(path: Path, rows: list[dict], overwrite: bool = False) -> None:
    """All or nothing (files.write_atomic)."""
    check_output(path, overwrite)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _csv_value(r[k]) for k in COLUMNS})
    write_atomic(path, text.getvalue(), overwrite=overwrite)


def _csv_value(value):
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else value
