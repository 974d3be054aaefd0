"""What-if replay of a trace: its measured costs, step by step and replica by replica, run
through the one simulator (pipeline/simulate.py) under a change.

    base = Measured.of(trace)                        # per step and replica: trace_costs
    replay(base, Change())                           # the run itself, as the simulator has it
    replay(base, Change(schedule="zb-h1", scales={("stage", 1, "F"): 0.5}))

Each measured step's costs (analysis.search_inputs.trace_costs of that step and replica) are
simulated with the change's schedule; a step's prediction is the slowest replica's pipeline
phase plus the run's mean time outside the phase (the step's start, its metrics, the wait for
the gradient ring), which no change here touches. A change of M scales each stage's F, B and
W by Change.rows (the whatif command gives predict's cost model of the new rows against the
run's: predict/rows.py), linearly in the rows without it, and keeps the hop, the gap and the
optimizer's tail. A change of placement or split (another number of stages, a V
instead of a loop) needs each layer's cost, which a trace of stages does not hold: refused.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace

import numpy as np

from mpihybrid.pipeline.plan import Schedule, ScheduleError, make_schedule, trace_schedule
from mpihybrid.pipeline.search_costs import CostsError
from mpihybrid.pipeline.simulate import Costs, simulate

KINDS = ("F", "B", "W")
MAX_STEPS = 64  # steps replayed (evenly spaced over the window): enough for a mean


class ReplayError(ValueError):
    """A change the trace cannot be replayed under (one line)."""


@dataclass
class Change:
    schedule: str | None = None  # None: the run's
    microbatches: int | None = None
    virtual_stages: int | None = None  # model chunks per rank (interleaving)
    partition: tuple[int, ...] | None = None  # layers per stage (another split)
    # ("stage", s, kind) | ("rank", r, kind) | ("all", -1, kind) -> factor (kind "F", "B", "W"
    # or "*"); "hop", "gap", "tail" -> factor
    scales: dict = field(default_factory=dict)
    # a change of M: per kind, each stage's cost of a micro-batch against the run's (predict.
    # rows.costed, what the whatif command passes); None: linear in the rows
    rows: dict[str, list[float]] | None = None
    # each message holds its link for a hop that did not queue, and the next one waits:
    # "duplex" (a link each way between two ranks) or "shared" (one wire both ways); None: every
    # message in flight at once, each delayed by the run's mean hop
    link: str | None = None
    merge_w: int | None = None  # each stage's W passes merged in groups of up to this (1: none)
    # with merge_w: per stage, what each further micro-batch adds to a merged W as a fraction of
    # one W (predict.rows.merge_ratios, from the row probe); None: 1 (merging saves nothing)
    merge_ratios: list[float] | None = None

    def text(self) -> str:
        parts = [f"schedule={self.schedule}"] if self.schedule else []
        parts += [f"microbatches={self.microbatches}"] if self.microbatches else []
        parts += [f"virtual_stages={self.virtual_stages}"] if self.virtual_stages else []
        if self.partition:
            parts.append("partition=" + ",".join(map(str, self.partition)))
        parts += [f"link={self.link}"] if self.link else []
        parts += [f"merge_w={self.merge_w}"] if self.merge_w else []
        for key, f in self.scales.items():
            parts.append(f"{scale_name(key)}x{f:g}")
        return ", ".join(parts) or "none (the run itself)"


def scale_name(key) -> str:
    if isinstance(key, str):
        return key
    (where, i), kind = key[:2], key[2]
    head = "" if where == "all" else f"{where}{i}"
    tail = "" if kind == "*" else kind
    return ".".join(p for p in (head, tail) if p)


@dataclass
class Measured:
    """A trace's measured steps: each one's costs per replica, step time and pipeline phase."""

    schedule: str
    pp: int
    dp: int
    m: int
    v: int
    early: bool
    steps: list[int]
    costs: list[list]  # [step][replica] SearchCosts
    step_time: list[float]
    phase: list[float]
    replica_ranks: list[list[int]]  # the world ranks of each replica, by pp rank
    global_batch: int | None
    source: str
    config: str = ""  # the trace's job (TOML): its blocks, for a change of placement
    ran: Schedule | None = None  # the schedule as it ran (a csv: one from the trace's copy)
    # model.vocab_parallel: the lists as they ran (costs.ran_lists: their passes were placed on
    # timed costs no schedule name rebuilds); None without
    lists: dict | None = None
    probe: list[float] | None = None  # each world rank's core speed (core_probe_s); None: unknown
    # (row_probe_rows, row_probe_s): each chunk's passes at two row counts (train.row_probe)
    row_probe: tuple | None = None

    def speeds(self, replica: int):
        """(the trace's stage ranks, probe seconds by pipeline rank) of one replica, for
        restage; None where the trace has no probe (an older trace, a GPU run)."""
        if not self.probe or self.ran is None:
            return None
        ranks = self.replica_ranks[replica]
        return self.ran.placement.stage_ranks, [self.probe[w] for w in ranks]

    @classmethod
    def of(cls, trace, path: str = "the trace") -> Measured:
        from mpihybrid.analysis.costs import ran_lists
        from mpihybrid.analysis.metrics import flat_config
        from mpihybrid.analysis.search_inputs import measured_steps, trace_costs
        from mpihybrid.trace.recorder import COMPUTE, KIND, step_times

        attrs, ev = trace.attrs, trace.events
        if not trace.has_actions:
            raise ReplayError(f"{path}: a trace with trace.events = false has no per-action costs")
        pp, dp = int(attrs["pp"]), int(attrs["dp"])
        present = set(np.unique(ev["rank"]).tolist())
        if len(present) < int(attrs.get("world_size", pp * dp)):
            raise ReplayError(f"{path} holds the events of {len(present)} of {pp * dp} ranks")
        steps = measured_steps(trace)
        if len(steps) > MAX_STEPS:
            steps = [steps[i] for i in np.linspace(0, len(steps) - 1, MAX_STEPS).astype(int)]
        per_step = step_times(ev[ev["kind"] == KIND["step"]])
        compute = ev[np.isin(ev["kind"], list(COMPUTE))]
        costs, times, phases = [], [], []
        for s in steps:
            rows = compute[compute["step"] == s]
            if s not in per_step or not len(rows):
                continue
            by_replica = []
            for k in range(dp):
                rows_k = ev[(ev["replica"] == k) & (ev["step"] == s)]
                mine = dataclasses.replace(trace, events=rows_k)
                try:
                    by_replica.append(trace_costs(mine, path, step=s))
                except CostsError as exc:
                    raise ReplayError(str(exc)) from None
            costs.append(by_replica)
            times.append(per_step[s])
            phases.append(_phase(rows))
        if not costs:
            raise ReplayError(f"{path}: no step with both actions and a step row")
        ranks = [[k * pp + r for r in range(pp)] for k in range(dp)]
        if str(attrs.get("order", "pipeline-inner")) == "data-inner":
            ranks = [[r * dp + k for r in range(pp)] for k in range(dp)]
        gb = flat_config(trace).get("train.global_batch")
        try:
            ran = trace_schedule(attrs)
        except ScheduleError as exc:
            raise ReplayError(f"{path}: {exc}") from None
        return cls(
            ran.name, pp, dp, ran.microbatches, ran.virtual_stages, ran.early_grad_send,
            steps[: len(costs)], costs, times, phases, ranks,
            int(gb) if gb is not None else None, path, trace.config, ran, ran_lists(ev),
            core_probe(attrs, pp * dp),
            (attrs["row_probe_rows"], attrs["row_probe_s"]) if "row_probe_s" in attrs else None,
        )  # fmt: skip

    @property
    def overhead(self) -> float:
        """Mean seconds of a step outside its pipeline phase."""
        return float(np.mean(self.step_time) - np.mean(self.phase))


def core_probe(attrs: dict, world: int) -> list[float] | None:
    """The trace's core_probe_s (train.probe), where it has one positive figure a rank."""
    probe = attrs.get("core_probe_s")
    if probe is None or len(probe) != world:
        return None
    values = [float(x) for x in probe]
    return values if all(np.isfinite(x) and x > 0 for x in values) else None


def _phase(rows: np.ndarray) -> float:
    """The slowest replica's pipeline phase: its first F/B/W start to its last end."""
    spans = [
        rows["end"][rows["replica"] == k].max() - rows["start"][rows["replica"] == k].min()
        for k in np.unique(rows["replica"])
    ]
    return float(max(spans))


def schedule_of(base: Measured, change: Change, mean_costs=None):
    """((compute lists, placement), the BlockLayout that carries the trace's costs to its
    stages, None where they are the trace's own): ReplayError when it cannot run at this pp and
    M, or needs another placement and the trace's job does not say its blocks."""
    from mpihybrid.pipeline.schedules import chunks_for

    name = change.schedule or base.schedule
    m = change.microbatches or base.m
    mine = base.ran.placement
    same = not (change.schedule or change.microbatches or change.virtual_stages or change.merge_w)
    if base.lists and same and not change.partition:
        return (base.lists, mine), None
    if name == "auto":
        return _searched(base, m, mine, mean_costs), None
    try:
        v = change.virtual_stages or (chunks_for(name, base.v) if change.schedule else base.v)
        csv = base.ran.csv if name == base.schedule else None  # the trace's copy of its CSV
        merge_w = change.merge_w or (base.ran.merge_w if base.ran is not None else 1)
        ran = make_schedule(name, base.pp, m, v, base.early, csv=csv, merge_w=merge_w)
        actions, placement = ran.lists(), ran.placement
    except ScheduleError as exc:
        raise ReplayError(f"whatif: {exc}") from None
    if base.lists:  # model.vocab_parallel: the passes placed on the new lists
        actions = _with_passes(base, actions, placement, m, mean_costs)
    if placement.stage_ranks == mine.stage_ranks and not change.partition:
        return (actions, placement), None
    from mpihybrid.analysis.restage import BlockLayout

    layout = BlockLayout.of(base.config, mine.num_stages, change.partition)
    if layout is None:
        raise ReplayError(
            f"whatif: {name} places {placement.num_stages} stages as {placement.style}, the "
            f"trace ran {mine.num_stages} as {mine.style}, and its job does not say its layers "
            "(no job, or model.partition = 'timed'): another placement or split needs them"
        )
    try:
        layout.new_ranges(placement.num_stages)
    except ValueError as exc:
        raise ReplayError(f"whatif: {exc}") from None
    return (actions, placement), layout


def _with_passes(base: Measured, actions, placement, m: int, mean_costs):
    """The lists with model.vocab_parallel's passes placed (vocab_passes.add_vocab_passes) on
    the trace's mean costs."""
    from mpihybrid.pipeline.vocab_passes import add_vocab_passes

    mean = mean_costs or mean_of(base)
    costs = sim_costs(base, mean, Change(), 0, m)
    try:
        return add_vocab_passes(actions, placement, m, costs, simulate)
    except ValueError as exc:
        raise ReplayError(f"whatif: {exc}") from None


def _searched(base: Measured, m: int, placement, mean_costs):
    """schedule=auto: the schedule search (pipeline/search) on the trace's mean costs at its
    own split and placement."""
    from mpihybrid.pipeline.search import search

    ranges = [range(i, i + 1) for i in range(placement.num_stages)]
    try:
        result = search(
            mean_costs, base.pp, m, placements=(placement.style,), ranges=ranges,
            time_limit=10.0, deterministic=True, tick=lambda: None,
        )  # fmt: skip
    except CostsError as exc:
        raise ReplayError(f"whatif: {exc}") from None
    return result.best.lists, result.best.placement


def replay(base: Measured, change: Change, plan=None) -> dict:
    """{"step", "phase", "bubble", "throughput"} predicted under `change` (means over the
    measured steps); plan: schedule_of's answer, when already built."""
    if plan is None:
        plan = schedule_of(base, change, mean_of(base))
    (actions, placement), layout = plan
    m = change.microbatches or base.m
    own = schedule_of(base, Change(), mean_of(base))[0] if change.link else None
    phases, bubbles = [], []
    for per_replica in base.costs:
        worst = None
        for k, costs in enumerate(per_replica):
            if own is not None:  # the step's own hold, before another split moves the stages
                hold = link_hold(own, sim_costs(base, costs, Change(), k, base.m), change.link)
            if layout is not None:
                costs = layout.restage(
                    presplit(costs), placement.num_stages, placement.stage_ranks, base.speeds(k)
                )
            sim_c = sim_costs(base, costs, change, k, m)
            if own is not None:
                hold_f = hold * change.scales.get("hop", 1.0)
                sim_c = replace(
                    sim_c, send=hold_f, wire=hold_f, shared_wire=change.link == "shared"
                )
            sim = simulate(actions, placement, sim_c)
            if worst is None or sim.makespan > worst.makespan:
                worst = sim
        phases.append(worst.makespan)
        bubbles.append(worst.bubble_fraction)
    phase = float(np.mean(phases))
    step = phase + base.overhead
    gb = base.global_batch
    return {
        "step": step,
        "phase": phase,
        "bubble": float(np.mean(bubbles)),
        "throughput": gb / step if gb and step > 0 else None,
    }


def link_hold(own_plan, costs: Costs, link: str) -> float:
    """Seconds a message holds its link ("duplex": one each way, "shared": one wire) in a step
    of these costs: the hold under which the run's own lists (own_plan: (actions, placement))
    take as long as with every message delayed by the step's mean hop and none waiting for
    another, so the run replays as it does without a link. Where no message meets another on
    its link that is the mean hop; where messages queue it is less, the rest being the queue."""
    actions, placement = own_plan
    target = simulate(actions, placement, costs).makespan
    lo, hi = 0.0, costs.send
    for _ in range(40 if hi > 0 else 0):
        hold = (lo + hi) / 2
        wired = replace(costs, send=hold, wire=hold, shared_wire=link == "shared")
        if simulate(actions, placement, wired).makespan < target:
            lo = hold
        else:
            hi = hold
    return hi


def measured_figures(base: Measured) -> dict:
    step = float(np.mean(base.step_time))
    gb = base.global_batch
    return {
        "step": step,
        "phase": float(np.mean(base.phase)),
        "throughput": gb / step if gb and step > 0 else None,
    }


def mean_of(base: Measured):
    """The steps' and replicas' costs averaged (the schedule search's input)."""
    every = [c for per in base.costs for c in per]
    first = every[0]
    fields = ("forward", "backward", "weight", "tail", "whole")
    mean = {f: tuple(np.mean([getattr(c, f) for c in every], axis=0).tolist()) for f in fields}
    if first.vocab:  # per pass and share
        vocab = np.mean([np.asarray(c.vocab, dtype=float) for c in every], axis=0)
        mean["vocab"] = tuple(tuple(v) for v in vocab.tolist())
    return dataclasses.replace(
        first, **mean, send=float(np.mean([c.send for c in every])),
        gap=float(np.mean([c.gap for c in every])),
    )  # fmt: skip


def sim_costs(base: Measured, costs, change: Change, replica: int, m: int) -> Costs:
    """simulate.Costs of one step and replica under the change's scales."""
    n = costs.units
    f, b, w = list(costs.forward), list(costs.backward), list(costs.weight)
    whole = list(costs.whole) if costs.whole else [b[i] + w[i] for i in range(n)]
    unsplit = [x == 0 for x in w]  # its backwards ran whole: "B" scales the whole one
    if any(unsplit):
        f, b, w, whole = _split_unknown(costs, f, b, w, whole)
    linear = base.m / m  # a micro-batch's rows, relative to the run's
    rows = change.rows if change.rows and m != base.m else None
    factor = {k: list(rows[k]) if rows else [linear] * n for k in KINDS}
    ranks = base.replica_ranks[replica]
    placement_ranks = costs.stage_ranks or tuple(range(n))
    plain = {"hop": 1.0, "gap": 1.0, "tail": 1.0}  # the costs not of one stage's kind
    for key, x in change.scales.items():
        if key in plain:
            plain[key] *= x
            continue
        where, i, kind = key
        for s in range(n):
            hit = (
                where == "all"
                or (where == "stage" and s == i)
                or (where == "rank" and ranks[placement_ranks[s]] == i)
            )
            for k in KINDS if kind == "*" else (kind,) if kind in KINDS else ():
                if hit:
                    factor[k][s] *= x
    ff, fb, fw = factor["F"], factor["B"], factor["W"]
    new_b = [b[s] * fb[s] for s in range(n)]
    new_w = [w[s] * fw[s] for s in range(n)]
    new_whole = [
        whole[s] * fb[s]
        if unsplit[s] or b[s] + w[s] <= 0
        else whole[s] * (new_b[s] + new_w[s]) / (b[s] + w[s])
        for s in range(n)
    ]
    for s in range(n):
        if unsplit[s]:  # its measured B was the whole backward: B x scales both halves
            new_w[s] = w[s] * fb[s]
    ratios = change.merge_ratios
    return Costs(
        forward=[f[s] * ff[s] for s in range(n)],
        backward=new_b,
        weight=new_w,
        weight_more=[new_w[s] * ratios[s] for s in range(n)] if ratios else None,
        send=costs.send * plain["hop"],
        whole=new_whole,
        tail=[x * plain["tail"] for x in costs.tail] if costs.tail else 0.0,
        gap=costs.gap * plain["gap"],
        vocab=_vocab_costs(costs, change, linear, plain["tail"]),
    )


def _vocab_costs(costs, change: Change, size: float, tail: float) -> dict | None:
    """model.vocab_parallel's passes per share: E, S, T, G scaled by the micro-batch's size and
    by the change's ("all", -1, "S")-style scales (a share is no stage: only "all" reaches
    them), their last G's tail by "tail"."""
    if not costs.vocab:
        return None
    out = {}
    for key, values in zip(("E", "S", "T", "G", "tail"), costs.vocab, strict=False):
        factor = tail if key == "tail" else size
        for (where, _, kind), x in ((k, x) for k, x in change.scales.items() if type(k) is tuple):
            factor *= x if where == "all" and kind in (key, "*") and key != "tail" else 1.0
        out[key] = [v * factor for v in np.atleast_1d(values)]
    return out


def presplit(costs):
    """`costs` with each whole-backward stage's B and W split (_split_unknown)."""
    f, b, w = list(costs.forward), list(costs.backward), list(costs.weight)
    whole = list(costs.whole) if costs.whole else [b[i] + w[i] for i in range(costs.units)]
    if any(x == 0 for x in w):
        f, b, w, whole = _split_unknown(costs, f, b, w, whole)
    return dataclasses.replace(costs, backward=tuple(b), weight=tuple(w), whole=())


def _split_unknown(costs, f, b, w, whole):
    """Stages whose backwards never ran split (W unknown: 0): B and W in the ratio the split
    stages measured, else half and half, so a zero-bubble schedule has a W to move."""
    split = [i for i in range(len(w)) if w[i] > 0 and b[i] > 0]
    ratio = float(np.mean([b[i] / (b[i] + w[i]) for i in split])) if split else 0.5
    for i in range(len(w)):
        if w[i] == 0:
            b[i], w[i] = whole[i] * ratio, whole[i] * (1 - ratio)
    return f, b, w, whole


def gain_table(base: Measured, plan=None) -> list[dict]:
    """The gain ceiling: the predicted step with each stage's F, B, W (and the hop) halved and
    zero, the rest as measured."""
    if plan is None:
        plan = schedule_of(base, Change(), None)
    now = replay(base, Change(), plan)["step"]
    mean = mean_of(base)
    rows = []
    for s in range(mean.units):
        for kind, values in zip(KINDS, (mean.forward, mean.backward, mean.weight), strict=True):
            if values[s] <= 0:
                continue
            rows.append(_gain(base, plan, now, f"stage {s} {kind}", ("stage", s, kind)))
    for kind, values in zip("ESTG", mean.vocab, strict=False):
        if max(values) > 0:  # model.vocab_parallel's passes, every share's at once
            rows.append(_gain(base, plan, now, f"the vocabulary {kind} passes", ("all", -1, kind)))
    if mean.send > 0:
        rows.append(_gain(base, plan, now, "the hop", "hop"))
    return sorted(rows, key=lambda r: r["zero"])


def _gain(base, plan, now: float, what: str, key) -> dict:
    half = replay(base, Change(scales={key: 0.5}), plan)["step"]
    zero = replay(base, Change(scales={key: 0.0}), plan)["step"]
    return {"what": what, "now": now, "half": half, "zero": zero}


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else math.nan
