"""Timing model of a schedule: when each action runs, the bubble, activations in flight, the grid.

    mpihybrid schedule show --all --pp 4 --microbatches 8

Each rank runs its compute actions in list order; an action starts once its rank is free and its
inputs exist (+ `send` seconds when they come from another rank, by the schedule's Placement).
With `wire` > 0 a message also holds its link that long, and the next one on the link waits for
it (one link each way between two ranks, or one for both ways with `shared_wire`).
Closed forms, F = B = W, are each schedule's spec (schedules.SPECS): naive (p-1)/p, GPipe and
1F1B (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1), ZB-H1 (p-1)/(3m+p-1) when m >= p, ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from mpihybrid.pipeline.actions import last_weight_actions, split_backwards
from mpihybrid.pipeline.liveness import Liveness
from mpihybrid.pipeline.schedules import (
    SCHEDULES,
    Action,
    Placement,
    ScheduleError,
    build_schedule,
    check_config,
    chunks_for,
    get_spec,
    placement_of,
)
from mpihybrid.pipeline.vocab_passes import (
    VOCAB_KINDS,
    add_vocab_passes,
    has_vocab,
    key_rank,
    vocab_inputs,
)
from mpihybrid.units import table


@dataclass(frozen=True)
class Costs:
    """Seconds per action: one number for every stage, or one per stage."""

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 1.0  # input gradient; a B without W also pays `weight`
    weight: float | Sequence[float] = 0.0
    # what each micro-batch beyond the first adds to a merged W (actions.merge_weights): under
    # `weight` where one GEMM over the merged rows beats one per micro-batch; None: `weight`
    weight_more: float | Sequence[float] | None = None
    send: float = 0.0  # latency of one point-to-point message
    # a whole backward (B and W in one action) where a schedule mixes whole and split ones on a
    # stage (dualpipev); None: backward + weight
    whole: float | Sequence[float] | None = None
    # added to the stage's last weight-gradient action of a step (actions.last_weight_actions):
    # the gradient buckets start in it, and on a CPU rank their work (the optimizer's update, the
    # ring's steps) runs inside it
    tail: float | Sequence[float] = 0.0
    gap: float = 0.0  # a rank's own time between two compute actions (posting sends, tracing)
    # seconds a message holds its link (0: no link is modelled, every message is in flight at
    # once); shared_wire: both directions between two ranks share one (a hub, a loopback)
    wire: float = 0.0
    shared_wire: bool = False
    # model.vocab_parallel: seconds of each vocabulary pass (E, S, T, G: vocab_passes.py), one
    # number for every share or one per share; "tail": added to a share's last G of a step (its
    # gradient ring and optimizer update run inside it, as a stage's tail)
    vocab: Mapping[str, float | Sequence[float]] | None = None

    def of(self, a: Action, split: bool, last: bool = False) -> float:
        """Seconds of compute action `a`; split: its backward is split; last: it is its stage's
        last weight-gradient action of the step."""

        def at(value: float | Sequence[float]) -> float:
            return value if isinstance(value, (int, float)) else value[a.stage]

        extra = at(self.tail) if last else 0.0
        if a.kind in VOCAB_KINDS:  # a.stage is the share
            vocab = self.vocab or {}
            tail = at(vocab.get("tail", 0.0)) if last and a.kind == "G" else 0.0
            return at(vocab.get(a.kind, 0.0)) + tail
        if a.kind == "F":
            return at(self.forward)
        if a.kind == "W":
            more = at(self.weight if self.weight_more is None else self.weight_more)
            return at(self.weight) + more * len(a.merged) + extra
        if split:
            return at(self.backward)
        if self.whole is not None:
            return at(self.whole) + extra
        return at(self.backward) + at(self.weight) + extra


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # per rank
    idle: list[float]  # per rank: makespan - busy
    bubble_fraction: float  # sum(idle) / (pp * makespan)
    peak_inflight: list[int]  # per stage
    peak_per_rank: list[float]  # per rank, in micro-batches of a rank's share (peak_per_rank)
    start: dict[Action, float]
    end: dict[Action, float]
    message_wait: float = 0.0  # with Costs.wire: the mean seconds a message waited for its link


def peak_inflight(actions: dict[int, list[Action]], placement: Placement) -> list[int]:
    """Most micro-batches alive at once per stage: from F to its last backward action (B, or W)."""
    split = split_backwards(actions)
    live = Liveness(split)
    for acts in actions.values():  # a stage lives on one rank: its own list orders it
        for a in acts:
            live.action(a)
    return [live.peak_count[s] for s in range(placement.num_stages)]


def peak_per_rank(actions: dict[int, list[Action]], placement: Placement) -> list[float]:
    """Most activations alive at once on each rank, in micro-batches of a whole rank's share of
    the model (a chunk's micro-batch counts 1/chunks): the paper's memory column, in units of
    one 1F1B stage's micro-batch (1F1B: p on rank 0; GPipe: m; ZB-V: about p)."""
    split = split_backwards(actions)
    peaks = []
    for rank in sorted(actions):
        live = Liveness(split)
        for a in actions[rank]:
            live.action(a, 1)
        peaks.append(live.peak_total_bytes / placement.chunks)
    return peaks


def simulate(
    actions: dict[int, list[Action]], placement: Placement, costs: Costs | None = None
) -> SimResult:
    """Run the compute actions of a (valid) schedule against `costs`; messages are not actions
    here, they add `costs.send` to every dependency that crosses ranks. A rank starts an action
    `costs.gap` after its previous one at the earliest (its own overhead, idle, not busy). With
    `costs.wire`, a message that finds its link busy also waits for it (the messages' waits are
    settled by running the timing again until they stop changing)."""
    costs = costs or Costs()
    kinds = ("F", "B", "W", *VOCAB_KINDS)
    compute = {r: [a for a in acts if a.kind in kinds] for r, acts in actions.items()}
    waits: dict = {}
    run = _timed(compute, placement, costs, waits)
    for _ in range(WIRE_ROUNDS if costs.wire > 0 else 0):
        new = _link_waits(run[3], placement, costs)
        if all(abs(new[k] - waits.get(k, 0.0)) < 1e-12 for k in new):
            break
        waits = new
        run = _timed(compute, placement, costs, waits)
    start, end, busy = run[:3]
    pp = len(actions)
    makespan = max(end.values(), default=0.0)
    idle = [makespan - busy[r] for r in compute]
    return SimResult(
        makespan=makespan,
        busy=[busy[r] for r in compute],
        idle=idle,
        bubble_fraction=sum(idle) / (pp * makespan) if makespan else 0.0,
        peak_inflight=peak_inflight(compute, placement),
        peak_per_rank=peak_per_rank(compute, placement),
        start=start,
        end=end,
        message_wait=sum(waits.values()) / len(waits) if waits else 0.0,
    )


WIRE_ROUNDS = 50  # the most timings a run of messages on busy links takes to settle


def _link_waits(messages: list, placement: Placement, costs: Costs) -> dict:
    """(key, receiving rank) -> seconds its message waits for its link: the messages on each
    link in the order they leave, each holding it `costs.wire` seconds."""
    free: dict = {}
    waits = {}
    for leaves, key, sender, receiver in sorted(messages):
        link = frozenset((sender, receiver)) if costs.shared_wire else (sender, receiver)
        starts = max(leaves, free.get(link, leaves))
        free[link] = starts + costs.wire
        waits[(key, receiver)] = starts - leaves
    return waits


def _timed(compute: dict, placement: Placement, costs: Costs, waits: dict) -> tuple:
    """(start, end, busy per rank, messages) of the compute lists; waits: seconds each message
    (key, receiving rank) waits for its link; messages: (leaves, key, sender, receiver)."""
    pp = len(compute)
    last = placement.num_stages - 1
    # the vocabulary passes present (vocab_passes.add_vocab_passes simulates lists it is still
    # filling: an action waits for those passes only)
    present = {(a.kind, a.stage, a.microbatch) for acts in compute.values() for a in acts}
    vocab = has_vocab(compute)
    split = split_backwards(compute)
    last_weight = last_weight_actions(a for acts in compute.values() for a in acts)
    last_g = {a.stage: a.microbatch for acts in compute.values() for a in acts if a.kind == "G"}
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> end time
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    clock = dict.fromkeys(compute, 0.0)  # when each rank is free again
    busy = dict.fromkeys(compute, 0.0)
    pc = dict.fromkeys(compute, 0)  # next action of each rank
    messages = []

    def inputs(a: Action) -> list[tuple[str, int, int]]:
        s, mb = a.stage, a.microbatch
        extra = [k for k in vocab_inputs(a, last, pp) if k in present] if vocab else []
        if a.kind == "F":
            return ([("F", s - 1, mb)] if s > 0 else []) + extra
        if a.kind == "B":
            return [("F", s, mb)] + ([("B", s + 1, mb)] if s < last else []) + extra
        return [("B", s, m) for m in a.microbatches] if a.kind == "W" else extra

    wired = costs.wire > 0
    progress = True
    while progress:
        progress = False
        for r, acts in compute.items():
            while pc[r] < len(acts):
                a = acts[pc[r]]
                needed = inputs(a)
                if any(k not in done for k in needed):
                    break
                ready = [
                    done[k] + (costs.send if key_rank(k, placement) != r else 0.0) for k in needed
                ]
                if wired:  # the waits for the links, and the messages that cross them
                    sent = [(done[k], k, key_rank(k, placement), r) for k in needed]
                    sent = [m for m in sent if m[2] != r]
                    ready += [t + costs.send + waits.get((k, r), 0.0) for t, k, _, _ in sent]
                    messages += sent
                free = clock[r] + (costs.gap if pc[r] else 0.0)
                start[a] = max([free, *ready])
                closes = (
                    last_g.get(a.stage) == a.microbatch
                    if a.kind in VOCAB_KINDS
                    else last_weight.get(a.stage) == (a.kind, a.microbatch)
                )
                duration = costs.of(a, (a.stage, a.microbatch) in split, closes)
                end[a] = clock[r] = start[a] + duration
                busy[r] += duration
                done.update(((a.kind, a.stage, m), end[a]) for m in a.microbatches)
                pc[r] += 1
                progress = True
    if any(pc[r] < len(acts) for r, acts in compute.items()):
        stuck = ", ".join(
            f"rank {r} at {acts[pc[r]]}" for r, acts in compute.items() if pc[r] < len(acts)
        )
        raise ScheduleError(f"simulate: dependencies cannot be met ({stuck}); run validate()")
    return start, end, busy, messages


def bubble_formula(name: str, pp: int, m: int, v: int = 1) -> float:
    """Closed-form idle fraction with equal costs (F = B, and = W where split): the spec's; a
    CSV schedule has none: its unit-cost simulation."""
    spec = get_spec(name)
    if spec.bubble is not None:
        return spec.bubble(pp, m, v)
    actions = build_schedule(name, pp, m, v)
    return simulate(actions, placement_of(name, pp, v), unit_costs(actions)).bubble_fraction


def bubble_text(name: str) -> str:
    """The closed form as text, e.g. "(p-1)/(m+p-1)"."""
    return get_spec(name).bubble_text


def unit_costs(actions: dict[int, list[Action]]) -> Costs:
    """One step per action: W costs a step only where backwards are split (then a whole B
    costs B + W, two steps)."""
    return Costs(forward=1.0, backward=1.0, weight=1.0 if split_backwards(actions) else 0.0)


def render_grid(
    actions: dict[int, list[Action]],
    placement: Placement,
    max_ranks: int | None = None,
    max_rows: int | None = None,
    result: SimResult | None = None,
) -> str:
    """ASCII step x rank grid of a unit-cost run: `F0`, `B3`, `W1`, `-` idle; with several chunks
    per rank, the stage tells them apart: `1F0`, `6B2`; where other backwards are split, a whole
    one (its B and W in one action) is `BW2` on its first step and `~` on its second
    (grid_legend).

    A grid wider than max_ranks shows the first and last max_ranks // 2 ranks with a `...`
    column between; longer than max_rows, the first and last max_rows // 2 rows with a line
    saying how many are left out. `result`: the unit-cost simulation, when already run."""
    result = result or simulate(actions, placement, unit_costs(actions))
    ranks = sorted(actions)
    if max_ranks is not None and len(ranks) > max_ranks:
        half = max(max_ranks // 2, 1)
        ranks = ranks[:half] + [None] + ranks[-half:]  # None: the column of ranks left out
    chunks = placement.chunks > 1
    split = split_backwards(actions)
    running = {}
    for a, t0 in result.start.items():
        label = str(a) if chunks else str(a)[len(str(a.stage)) :]
        if split and a.kind == "B" and (a.stage, a.microbatch) not in split:
            label = label.replace("B", "BW", 1)  # a whole backward: B and W in one action
        rank = key_rank((a.kind, a.stage, a.microbatch), placement)
        for i, t in enumerate(range(math.floor(t0), math.ceil(result.end[a]))):
            running[(rank, t)] = label if i == 0 else "~"
    steps = math.ceil(result.makespan)
    digits = len(str(max(steps - 1, 0)))
    width = max(
        [len(f"rank {r}") for r in ranks if r is not None] + [len(c) for c in running.values()]
    )

    def cell(r, t) -> str:
        return "..." if r is None else running.get((r, t), "-")

    head = "  ".join(("..." if r is None else f"rank {r}").ljust(width) for r in ranks)
    lines = [" " * (digits + 7) + head.rstrip()]
    rows = range(steps)
    if max_rows is not None and steps > max_rows:
        half = max(max_rows // 2, 1)
        rows = [*range(half), None, *range(steps - half, steps)]
    for t in rows:
        if t is None:
            lines.append(f"... {steps - 2 * half} steps left out ...")
            continue
        row = "  ".join(cell(r, t).ljust(width) for r in ranks)
        lines.append(f"step {t:0{digits}d}: {row}".rstrip())
    return "\n".join(lines)


def grid_legend(actions: dict[int, list[Action]], v: int) -> str:
    """What render_grid's cells mean, for these actions."""
    if split_backwards(actions):
        kinds = (
            "F forward, B backward (input gradient), W weight gradient, BW a whole "
            "backward (B and W in one action) and ~ its second step"
        )
    else:
        kinds = "F forward, B backward"
    chunk = ", a leading digit the model chunk" if v > 1 else ""
    if has_vocab(actions):  # E and G (gathers, scatter-adds) take no step of the unit grid
        kinds += ", S the vocabulary share's logits and statistics, T their gradient (S = 1, T = 2)"
    return f"{kinds}, - idle; the number is the micro-batch{chunk}"


UNIT_VOCAB = {"E": 0.0, "S": 1.0, "T": 2.0, "G": 0.0}  # a share: 1/p of a head about p layers'


def vocab_lists(actions: dict[int, list[Action]], placement: Placement, m: int):
    """(lists, unit costs) with model.vocab_parallel's passes placed on the unit grid."""
    costs = replace(unit_costs(actions), vocab=UNIT_VOCAB)
    return add_vocab_passes(actions, placement, m, costs, simulate), costs


GRID_RANKS = 8  # describe(): ranks shown before the grid is summarised
GRID_ROWS = 64  # ... and rows


def describe(
    name: str,
    pp: int,
    m: int,
    v: int = 1,
    early_grad_send: bool = False,
    *,
    grid: str = "auto",
    vocab: bool = False,
    merge_w: int = 1,
) -> str:
    """Grid + predicted and simulated bubble + peak activations per stage, for one schedule.
    grid: "full", "auto" (summarised past GRID_RANKS ranks or GRID_ROWS rows) or "none".
    vocab: with model.vocab_parallel's passes (vocab_passes.py). name: or its spec. merge_w:
    its W passes merged in groups of up to that many (a merged W takes a step each)."""
    spec = get_spec(name)  # a spec made of a trace's CSV has no file to read again
    actions = build_schedule(spec, pp, m, v, early_grad_send, merge_w=merge_w)
    placement = placement_of(spec, pp, v)
    costs = unit_costs(actions)
    if vocab:
        actions, costs = vocab_lists(actions, placement, m)
    result = simulate(actions, placement, costs)
    peaks = " ".join(f"s{s}:{n}" for s, n in enumerate(result.peak_inflight))
    if len(result.peak_inflight) > GRID_RANKS and grid != "full":
        most = max(result.peak_inflight)
        peaks = f"at most {most} (stage {result.peak_inflight.index(most)})"
    early = ", gradients sent before W" if early_grad_send else ""
    early += f", W merged in {merge_w}s" if merge_w > 1 else ""
    where = " ".join(f"r{r}:{','.join(map(str, placement.stages_of(r)))}" for r in range(pp))
    lines = [
        f"{spec.name}: pp={pp} num_microbatches={m} virtual_stages={v} (one step per action{early})"
    ]
    if grid != "none":
        limits = (None, None) if grid == "full" else (GRID_RANKS, GRID_ROWS)
        lines.append(render_grid(actions, placement, *limits, result=result))
        lines.append(grid_legend(actions, placement.chunks))
    if placement.chunks > 1:
        lines.append(f"placement {placement.style}: stages per rank {where}")
    if spec.note:
        lines.append(spec.note)
    lines += [
        f"bubble: predicted {spec.bubble_text} = {bubble_formula(spec, pp, m, v):.3f}, "
        f"simulated {result.bubble_fraction:.3f}",
        f"peak activations in flight per stage: {peaks}",
        f"peak activations per rank (micro-batches of a rank's share; paper: {spec.memory_text}):"
        f" {max(result.peak_per_rank):g}",
    ]
    return "\n".join(lines)


def compare(pp: int, m: int, v: int = 2, early_grad_send: bool = False, vocab: bool = False) -> str:
    """One row per schedule: placement, closed form, simulated bubble (F = B = W = 1), peak
    activations per rank (vs the paper's memory column) and per stage; early_grad_send simulates
    each as training runs it (B, send, then W); vocab: with model.vocab_parallel's passes placed
    on each (vocab_lists), which the simulated bubble and the peaks then count."""
    early = "; gradients sent before W" if early_grad_send else ""
    if vocab:
        early += (
            "; with model.vocab_parallel's passes placed on every rank (S = 1, T = 2, E and G "
            "free): the simulated bubble and the peaks count them, the formula does not"
        )
    caption = (
        f"pp={pp} num_microbatches={m}; F = B = W = 1 (an unsplit backward costs B + W){early}; "
        "rank peak = most activations alive on a rank, in micro-batches of its share of the "
        "model (paper = the zero-bubble paper's memory column); stage peak = most on one stage"
    )
    header = ["schedule", "v", "place", "formula", "predicted", "simulated", "paper"]
    header += ["rank peak", "stage peak", "note"]
    rows = []
    for name in SCHEDULES:
        spec, nv = get_spec(name), chunks_for(name, v)
        try:
            check_config(name, pp, m, nv)
        except ScheduleError as exc:
            rows.append([name, nv, spec.placement, *[""] * 6, f"not legal: {exc}"])
            continue
        actions = build_schedule(name, pp, m, nv, early_grad_send)
        costs = Costs(1.0, 1.0, 1.0)
        if vocab:
            actions, costs = vocab_lists(actions, placement_of(name, pp, nv), m)
        result = simulate(actions, placement_of(name, pp, nv), costs)
        predicted = bubble_formula(name, pp, m, nv)
        rows.append(
            [name, nv, spec.placement, spec.bubble_text, f"{predicted:.3f}"]
            + [f"{result.bubble_fraction:.3f}", spec.memory_text]
            + [f"{max(result.peak_per_rank):g}", max(result.peak_inflight), ""]
        )
    lines = [caption, *table(header, rows, left=(2, 3, 6, 9))]
    return "\n".join(lines)
