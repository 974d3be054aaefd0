"""Why a simulated bubble differs from the measured one: each term the simulator models, added
one at a time, on traces of real runs (`mpihybrid sweep --traces DIR` keeps them).

    python benchmarks/bubble_terms.py runs/sweep_traces/*/repeat-*.h5

Per trace, the measured bubble (analysis.metrics.bubble_summary) and the simulated one as the
simulator grows (each column keeps the ones before it):

  means     one simulation, each stage's mean F, B and W over every action of the kind (the
            simulator before #26's fixes), the median message hop
  +whole    a whole backward (B and W in one action) costed apart from a split one
  +tail     the stage's last weight-gradient action of a step apart (the gradient buckets'
            optimizer update runs inside it), the others' mean for the rest
  +gap      a rank's mean time between two actions when it waits for nothing
  +mean hop the mean message hop instead of the median
  per step  each step simulated with its own costs, the fractions averaged as the measured ones
            are: what `analyze` and `sweep` report as predicted
  replay    each action's own duration (not a prediction: how much is the timing model's)

and measured / per step - 1.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from mpihybrid.analysis.costs import stage_costs
from mpihybrid.analysis.messages import message_latency
from mpihybrid.analysis.metrics import _measured_steps, bubble_summary
from mpihybrid.pipeline.csv_schedule import from_trace
from mpihybrid.pipeline.schedules import build_schedule, placement_of
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.trace.read import load
from mpihybrid.trace.recorder import COMPUTE

COLUMNS = ("means", "+whole", "+tail", "+gap", "+mean hop", "per step", "replay")


class _Durations:
    """simulate()'s costs from each action's measured duration in one step."""

    def __init__(self, rows: np.ndarray, send: float, gap: float) -> None:
        self.send, self.gap = send, gap
        self.seconds = {
            (COMPUTE[r["kind"]], int(r["stage"]), int(r["microbatch"])): r["end"] - r["start"]
            for r in rows
        }

    def of(self, a, split: bool, last: bool = False) -> float:
        return self.seconds[(a.kind, a.stage, a.microbatch)]


def _means(rows: np.ndarray, num_stages: int, whole_apart: bool) -> dict:
    """Per stage mean F, B, W over every action of the kind; whole_apart: a whole B's own."""
    weights = {(r["step"], r["stage"], r["microbatch"]) for r in rows if COMPUTE[r["kind"]] == "W"}
    seconds: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        kind = COMPUTE[r["kind"]]
        if whole_apart and kind == "B" and (r["step"], r["stage"], r["microbatch"]) not in weights:
            kind = "BW"
        seconds.setdefault((kind, int(r["stage"])), []).append(r["end"] - r["start"])

    def mean(kind: str, s: int) -> float:
        return float(np.mean(seconds[(kind, s)])) if (kind, s) in seconds else 0.0

    stages = range(num_stages)
    costs = {name: [mean(k, s) for s in stages] for name, k in
             (("forward", "F"), ("backward", "B"), ("weight", "W"))}  # fmt: skip
    for s in stages:  # a stage with whole backwards only: B is its whole backward
        if not costs["backward"][s]:
            costs["backward"][s] = mean("BW", s)
    if whole_apart:
        costs["whole"] = [
            mean("BW", s) if ("BW", s) in seconds else costs["backward"][s] + costs["weight"][s]
            for s in stages
        ]
    return costs


def terms(path: Path, skip: int) -> dict:
    trace = load(path)
    a = trace.attrs
    name, pp, m = from_trace(a), int(a["pp"]), int(a["microbatches"])
    v, early = int(a.get("virtual_stages", 1)), bool(a.get("early_grad_send", False))
    summary = bubble_summary(trace.events, name, pp, m, v, skip_steps=skip, early_grad_send=early)
    events = trace.events[np.isin(trace.events["step"], summary["steps"])]
    rows = events[np.isin(events["kind"], list(COMPUTE))]
    actions, placement = build_schedule(name, pp, m, v, early), placement_of(name, pp, v)
    median_hop, mean_hop = message_latency(events), message_latency(events, mean=True)
    num_stages = pp * v
    fitted = stage_costs(rows, num_stages, mean_hop)

    def sim(**costs) -> float:
        return simulate(actions, placement, Costs(**costs)).bubble_fraction

    out = {"schedule": str(a["schedule"]), "measured": summary["measured"]}
    out["means"] = sim(**_means(rows, num_stages, False), send=median_hop)
    out["+whole"] = sim(**_means(rows, num_stages, True), send=median_hop)
    no_gap = {k: val for k, val in fitted.items() if k != "gap"}
    out["+tail"] = sim(**no_gap, send=median_hop)
    out["+gap"] = sim(**stage_costs(rows, num_stages, median_hop), send=median_hop)
    out["+mean hop"] = sim(**fitted, send=mean_hop)
    out["per step"] = summary["predicted"]
    steps = _measured_steps(rows, 0)
    out["replay"] = statistics.mean(
        simulate(actions, placement, _Durations(rows[rows["step"] == s], mean_hop,
                                                fitted["gap"])).bubble_fraction
        for s in steps
    )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    args = parser.parse_args()
    head = f"{'trace':<44} {'schedule':<17} {'measured':>8} " + " ".join(f"{c:>9}" for c in COLUMNS)
    print(head + "  measured vs per step")
    for path in args.traces:
        t = terms(path, args.skip)
        cells = " ".join(f"{t[c]:>9.3f}" for c in COLUMNS)
        apart = t["measured"] / t["per step"] - 1 if t["per step"] else float("nan")
        label = "/".join(path.parts[-2:])
        print(f"{label:<44} {t['schedule']:<17} {t['measured']:>8.3f} {cells}  {apart:+.0%}")


if __name__ == "__main__":
    main()
