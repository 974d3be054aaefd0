"""Pipeline schedules as data: which rank runs which forward and backward, in which order.

A schedule is `{pp_rank: [Action, ...]}` plus its Placement (which rank holds each stage); the
runtime executes each list in order and decides nothing itself. All of it is pure Python (no
MPI): schedules are built, validated, dry-run for deadlocks, simulated and drawn without starting
a process:

    mpihybrid schedule show --schedule zb-v --pp 4 --microbatches 8

Every schedule is one registered ScheduleSpec (SPECS): its builder, its placement (loop or V),
chunks per rank, the fewest micro-batches it accepts, its bubble formula, whether it splits B
and W. `csv:PATH` names a schedule read from torch's CSV format (csv_schedule.py).

p = pp (pipeline ranks), v = model chunks (stages) per rank, m = num_microbatches,
s = global stage 0 .. p*v-1, mb = micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable

from mpihybrid.pipeline import vocab_passes as vp
from mpihybrid.pipeline.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    ScheduleError,
    merge_weights,
    message_key,
    send_grads_early,
)
from mpihybrid.pipeline.csv_schedule import csv_spec
from mpihybrid.pipeline.loop_schedules import gpipe, interleaved, naive, one_f_one_b, zb_h1
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.spec import ScheduleSpec
from mpihybrid.pipeline.v_schedules import dualpipev, v_half, zb_h2, zb_v

__all__ = [
    "Action",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Placement",
    "ScheduleError",
    "ScheduleSpec",
    "message_key",
]


def _each_rank(make: Callable[[int, int, int], list[Action]]):
    """A builder from a one-rank generator make(pp, m, rank)."""
    return lambda pp, m, v: {r: make(pp, m, r) for r in range(pp)}


def _zb_h1_bubble(p: int, m: int, v: int) -> float:
    # m < p: the first gradient reaches rank 0 after 2p-1 steps and rank 0 still has 2m steps of
    # B and W to run, so the makespan is 2m+2p-1 rather than 3m+p-1
    d = max(0, p - m)
    return (p - 1 + d) / (3 * m + p - 1 + d)


def _zb_v_bubble(p: int, m: int, v: int) -> float:
    # per rank 6m unit actions (2 chunks x F, B, W); the makespan is 6m+p-1 once m >= (3p-1)/2,
    # before that the first gradient's round trip, 4m+4p-2
    return 1.0 - 6 * m / max(6 * m + p - 1, 4 * m + 4 * p - 2)


def _one(pp: int, v: int) -> int:
    return 1


def _one_chunk(name, build, bubble_text, bubble, memory_text) -> ScheduleSpec:
    """A schedule of one chunk a rank, placed as a loop, its backwards whole."""
    return ScheduleSpec(
        name=name,
        build=_each_rank(build),
        placement="loop",
        chunks=1,
        min_microbatches=_one,
        bubble_text=bubble_text,
        bubble=bubble,
        splits_backward=False,
        memory_text=memory_text,
    )


SPECS: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        _one_chunk("naive", naive, "(p-1)/p", lambda p, m, v: (p - 1) / p, "1"),
        _one_chunk("gpipe", gpipe, "(p-1)/(m+p-1)", lambda p, m, v: (p - 1) / (m + p - 1), "m"),
        _one_chunk(
            "1f1b", one_f_one_b, "(p-1)/(m+p-1)", lambda p, m, v: (p - 1) / (m + p - 1), "p"
        ),
        ScheduleSpec(
            name="interleaved-1f1b",
            build=lambda pp, m, v: {r: interleaved(pp, m, v, r) for r in range(pp)},
            placement="loop",
            chunks=0,
            min_microbatches=lambda pp, v: pp,
            bubble_text="(p-1)/(v*m+p-1)",
            bubble=lambda p, m, v: (p - 1) / (v * m + p - 1),
            splits_backward=False,
            memory_text="p(1+(p-1)/(pv))",
            m_multiple_of_pp=True,
        ),
        ScheduleSpec(
            name="zb-h1",
            build=_each_rank(zb_h1),
            placement="loop",
            chunks=1,
            min_microbatches=_one,
            bubble_text="(p-1+d)/(3m+p-1+d), d=max(0,p-m)",
            bubble=_zb_h1_bubble,
            splits_backward=True,
            memory_text="p",
        ),
        ScheduleSpec(
            name="zb-h2",
            build=zb_h2,
            placement="loop",
            chunks=1,
            min_microbatches=_one,
            bubble_text="zb-h1's: a step ends in a flush",
            bubble=_zb_h1_bubble,
            splits_backward=True,
            memory_text="2p-1",
            note="zb-h2: its zero bubble needs a step's tail to overlap the next step's head; "
            "every step here ends with a world Allreduce, so one step idles like zb-h1",
        ),
        ScheduleSpec(
            name="zb-v",
            build=zb_v,
            placement="v",
            chunks=2,
            min_microbatches=_one,
            bubble_text="(p-1)/(6m+p-1) when m >= (3p-1)/2",
            bubble=_zb_v_bubble,
            splits_backward=True,
            memory_text="p",
        ),
        ScheduleSpec(
            name="dualpipev",
            build=dualpipev,
            placement="v",
            chunks=2,
            min_microbatches=lambda pp, v: 2 * pp,
            bubble_text="(p-1)/(6m+p-1)",
            bubble=_zb_v_bubble,
            splits_backward=True,
            memory_text="p+1",
            note="dualpipev: each overlapped F&B pair runs as F then B on a CPU rank (one "
            "core's compute; DualPipe overlaps them on two CUDA streams)",
        ),
        ScheduleSpec(
            name="v-half",
            build=v_half,
            placement="v",
            chunks=2,
            min_microbatches=_one,
            bubble_text="simulated (no closed form)",
            bubble=None,
            splits_backward=True,
            memory_text="(p+2)//2",
            note="v-half: a V holding at most (p+2)//2 micro-batches of a rank's share, "
            "list-scheduled (not the paper's building block); its bubble is about 1F1B's or less",
        ),
    )
}
SCHEDULES = tuple(SPECS)


def get_spec(name: str | ScheduleSpec) -> ScheduleSpec:
    """The registered spec of `name`, or for `csv:PATH` the spec of that file's schedule (a spec:
    itself, as every function here takes either; plan.make_schedule passes a CSV's text's)."""
    if isinstance(name, ScheduleSpec):
        return name
    if name.startswith("csv:"):
        return csv_spec(name)
    if name not in SPECS:
        raise ScheduleError(
            f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)} or csv:PATH"
        )
    return SPECS[name]


def chunks_for(name: str, virtual_stages: int | None = None) -> int:
    """Model chunks per rank `name` runs: fixed by its spec (1, or 2 for a V), else
    virtual_stages (default 2)."""
    spec = get_spec(name)
    return spec.chunks or (virtual_stages if virtual_stages is not None else 2)


def placement_of(name: str | ScheduleSpec, pp: int, virtual_stages: int = 1) -> Placement:
    """Which pp rank holds each global stage when `name` runs (check_config first)."""
    return get_spec(name).make_placement(pp, virtual_stages)


def check_config(
    name: str | ScheduleSpec, pp: int, num_microbatches: int, virtual_stages: int
) -> None:
    """Raise ScheduleError naming the broken rule and its values; return None when legal."""
    m, v = num_microbatches, virtual_stages
    spec = get_spec(name)
    name = spec.name
    if pp < 1:
        raise ScheduleError(f"{name}: pp must be >= 1, got pp={pp}")
    if m < 1:
        raise ScheduleError(f"{name}: num_microbatches must be >= 1, got {m}")
    if spec.chunks == 0 and v < 2:
        raise ScheduleError(f"{name} needs virtual_stages >= 2 model chunks per rank, got {v}")
    if spec.chunks and v != spec.chunks:
        runs = "one model chunk" if spec.chunks == 1 else f"{spec.chunks} model chunks"
        raise ScheduleError(
            f"{name} runs {runs} per rank: virtual_stages must be {spec.chunks}, got {v}"
            + (" (interleaved-1f1b runs several)" if spec.chunks == 1 else "")
        )
    if spec.check is not None:
        spec.check(pp, m, v)
    fewest = spec.min_microbatches(pp, v)
    if m < fewest:
        raise ScheduleError(f"{name} needs num_microbatches >= {fewest} at pp={pp}, got {m}")
    if spec.m_multiple_of_pp and m % pp:
        raise ScheduleError(f"{name} needs num_microbatches % pp == 0: {m} % {pp} = {m % pp}")


def build_schedule(
    name: str | ScheduleSpec,
    pp: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    early_grad_send: bool = False,
    *,
    merge_w: int = 1,
) -> dict[int, list[Action]]:
    """The compute actions (F, B, W) of every pp rank, checked by validate() against the
    schedule's placement (placement_of).

    early_grad_send: split the backwards whose gradient crosses ranks (send_grads_early), as
    training runs them by default; without it, the schedule as its paper draws it. merge_w: a
    stage's W passes merged in groups of up to that many micro-batches (merge_weights; 1: none).
    """
    spec = get_spec(name)
    check_config(spec, pp, num_microbatches, virtual_stages)
    name, placement = spec.name, spec.make_placement(pp, virtual_stages)
    actions = spec.build(pp, num_microbatches, virtual_stages)
    if early_grad_send:
        actions = send_grads_early(actions, placement)
    if merge_w > 1:
        actions = merge_weights(actions, merge_w)
    try:
        validate(actions, placement, num_microbatches)
    except ScheduleError as exc:
        raise ScheduleError(f"{name}: {exc}") from None
    return actions


# ---------------------------------------------------------------- lowering


def lower(compute: dict[int, list[Action]], placement: Placement) -> dict[int, list[Action]]:
    """Add the messages: SEND right after the F/B that produced a tensor, RECV right before the
    F/B that consumes it. Stages on the same rank hand tensors over locally (no message)."""
    last = placement.num_stages - 1
    lowered: dict[int, list[Action]] = {}
    for rank, actions in compute.items():
        out = lowered[rank] = []
        for a in actions:
            if a.kind not in COMPUTE_KINDS + vp.VOCAB_KINDS:  # a share's pass: its messages inside
                raise ScheduleError(f"lower() takes compute actions only, got {a} on rank {rank}")
            s, mb = a.stage, a.microbatch
            prev = placement.rank_of(s - 1) if s > 0 else rank
            nxt = placement.rank_of(s + 1) if s < last else rank
            if a.kind == "F" and prev != rank:
                out.append(Action(s, "RECV_F", mb, prev))
            if a.kind == "B" and nxt != rank:
                out.append(Action(s, "RECV_B", mb, nxt))
            out.append(a)
            if a.kind == "F" and nxt != rank:
                out.append(Action(s, "SEND_F", mb, nxt))
            if a.kind == "B" and prev != rank:
                out.append(Action(s, "SEND_B", mb, prev))
    return lowered


# ---------------------------------------------------------------- validation and dry run


def format_lists(actions: dict[int, list[Action]], mark: tuple[int, int] | None = None) -> str:
    """Step x rank grid of the lists themselves (step = position in a rank's list), like
    torch.distributed.pipelining; `mark=(rank, step)` brackets that cell and flags its row."""
    ranks = sorted(actions)
    rows = max([len(a) for a in actions.values()] + [mark[1] + 1 if mark else 0])
    cells = [
        [str(actions[r][i]) if i < len(actions[r]) else "" for r in ranks] for i in range(rows)
    ]
    if mark is not None:
        col = ranks.index(mark[0])
        cells[mark[1]][col] = f"[{cells[mark[1]][col] or 'end'}]"
    width = max([len(f"rank {r}") for r in ranks] + [len(c) for row in cells for c in row])
    digits = len(str(max(rows - 1, 0)))
    lines = [" " * (digits + 7) + "  ".join(f"rank {r}".ljust(width) for r in ranks).rstrip()]
    for i, row in enumerate(cells):
        line = f"step {i:0{digits}d}: " + "  ".join(c.ljust(width) for c in row)
        if mark is not None and i == mark[1]:
            line += f"  <-- ERROR HERE (rank {mark[0]})"
        lines.append(line.rstrip())
    return "\n".join(lines)


def _fail(actions: dict[int, list[Action]], at: tuple[int, int], why: str) -> ScheduleError:
    """The first line names the rank, the step and the action (`<-- here`), the grid follows."""
    acts = actions.get(at[0], [])
    cell = str(acts[at[1]]) if at[1] < len(acts) else "end"
    return ScheduleError(
        f"rank {at[0]} step {at[1]} [{cell}] <-- here: {why}\n{format_lists(actions, at)}"
    )


def _run(
    actions: dict[int, list[Action]], num_stages: int, *, per_rank: bool, synchronous: bool
) -> dict[int, tuple[int, str]]:
    """Execute every rank's list in order with blocking RECVs; {rank: (step, why)} for the ranks
    that cannot finish. per_rank=False lets every rank see every tensor (compute lists)."""
    # Over 60 lines on purpose: one interpreter whose helpers (current, needs, advance) share
    # its program counters and tensor sets; split apart they would pass all that state around.
    pp, last = len(actions), num_stages - 1
    pc = dict.fromkeys(actions, 0)
    # posted: buffered (message_key, destination) not received; made: every (kind, stage, mb) run
    shared, posted, made, vocab = set(), set(), set(), vp.has_vocab(actions)
    # tensors a rank holds: ("F", s, mb) = output of F on stage s, ("B", s, mb) = input grad
    have = {r: set() if per_rank else shared for r in actions}

    def current(r: int) -> Action | None:
        return actions[r][pc[r]] if pc[r] < len(actions[r]) else None

    def needs(r: int, a: Action) -> tuple[str, int, int] | None:
        """The tensor `a` cannot run without, if rank r lacks it."""
        s, mb = a.stage, a.microbatch
        if a.kind == "F":
            wanted = [("F", s - 1, mb)] if s > 0 else []
        elif a.kind == "B":
            wanted = [("F", s, mb)] + ([("B", s + 1, mb)] if s < last else [])
        elif a.kind == "W":
            wanted = [("B", s, m) for m in a.microbatches]
        elif a.kind.startswith("SEND"):
            wanted = [message_key(a)]
        else:
            wanted = []
        missing = next((t for t in wanted if t not in have[r]), None)
        return missing or (vp.missing_input(a, last, pp, made) if vocab else None)

    def advance(r: int) -> bool:
        a = current(r)
        missing = needs(r, a)
        if missing is not None:
            what = {"F": "output of F", "B": "input gradient from B"}.get(missing[0], missing[0])
            stuck[r] = f"{a} waits for the {what} of stage {missing[1]} micro-batch {missing[2]}"
            return False
        if a.kind in COMPUTE_KINDS or a.kind in vp.VOCAB_KINDS:
            made.update((a.kind, a.stage, m) for m in a.microbatches)
            if a.kind in ("F", "B"):
                have[r].add((a.kind, a.stage, a.microbatch))
        elif a.kind.startswith("SEND") and not synchronous:
            posted.add((message_key(a), a.peer))
        elif a.kind.startswith("RECV") and not synchronous:
            if (message_key(a), r) not in posted:
                stuck[r] = f"{a} waits for the matching SEND on rank {a.peer}"
                return False
            posted.discard((message_key(a), r))
            have[r].add(message_key(a))
        else:  # rendezvous: a send and its receive complete together
            sender, receiver = (r, a.peer) if a.kind.startswith("SEND") else (a.peer, r)
            other = current(a.peer) if 0 <= a.peer < pp else None
            match = (
                other is not None
                and other.kind[:4] != a.kind[:4]
                and other.peer == r
                and message_key(other) == message_key(a)
                and needs(sender, actions[sender][pc[sender]]) is None
            )
            if not match:
                stuck[r] = f"{a} waits for rank {a.peer} to reach the matching " + (
                    "RECV" if a.kind.startswith("SEND") else "SEND"
                )
                return False
            have[receiver].add(message_key(a))
            pc[a.peer] += 1
        pc[r] += 1
        return True

    stuck: dict[int, str] = {}
    progress = True
    while progress:
        progress = False
        for r in actions:
            while current(r) is not None and advance(r):
                progress = True
    return {r: (pc[r], stuck[r]) for r in actions if current(r) is not None}


def validate(actions: dict[int, list[Action]], placement: Placement, num_microbatches: int) -> None:
    """Raise ScheduleError (with the grid, offending cell marked) unless every (stage, mb) gets
    exactly one F and one B on its own rank, F before B, at most one W after its B, messages pair
    up, and the cross-stage dependencies can be met in list order. Compute or lowered lists."""
    m, num_stages, pp = num_microbatches, placement.num_stages, placement.pp
    if sorted(actions) != list(range(pp)):
        raise ScheduleError(f"expected one list per pp rank 0..{pp - 1}, got {sorted(actions)}")
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, stage, mb) -> (rank, step)
    messages: dict[str, dict[tuple, tuple[int, int]]] = {"SEND": {}, "RECV": {}}
    for rank, acts in actions.items():
        for step, a in enumerate(acts):
            at, s, mb = (rank, step), a.stage, a.microbatch
            if a.kind in vp.VOCAB_KINDS:  # a share's pass, on the share's own rank
                if why := vp.vocab_problem(a, rank, m, seen):
                    raise _fail(actions, at, why)
                seen[(a.kind, s, mb)] = at
                continue
            if a.kind not in COMPUTE_KINDS + COMM_KINDS:
                raise _fail(actions, at, f"unknown action kind {a.kind!r}")
            if not (0 <= s < num_stages and all(0 <= b < m for b in a.microbatches)):
                why = f"{a} is outside stages 0..{num_stages - 1} x micro-batches 0..{m - 1}"
                raise _fail(actions, at, why)
            if a.merged and a.kind != "W":
                raise _fail(actions, at, f"{a}: only a W merges micro-batches")
            if placement.rank_of(s) != rank:
                raise _fail(actions, at, f"stage {s} lives on rank {placement.rank_of(s)}")
            if a.kind in COMM_KINDS:
                other = s + 1 if a.kind in ("SEND_F", "RECV_B") else s - 1
                if not 0 <= other < num_stages or a.peer != placement.rank_of(other):
                    why = f"{a.kind} of stage {s} needs peer = rank of stage {other}, got {a.peer}"
                    raise _fail(actions, at, why)
                side = messages[a.kind[:4]]
                if message_key(a) in side:
                    raise _fail(actions, at, f"second {a.kind} for the same message")
                side[message_key(a)] = at
                continue
            for mb in a.microbatches:  # a merged W: each micro-batch it covers
                if (a.kind, s, mb) in seen:
                    raise _fail(actions, at, f"second {a.kind} for stage {s} micro-batch {mb}")
                before = {"B": "F", "W": "B"}.get(a.kind)
                if before and (before, s, mb) not in seen:
                    which = f" (micro-batch {mb})" if a.merged else ""
                    raise _fail(actions, at, f"{a} runs before its {before}{which}")
                seen[(a.kind, s, mb)] = at
    for s in range(num_stages):
        rank = placement.rank_of(s)
        for mb in range(m):
            if ("F", s, mb) not in seen:
                raise _fail(actions, (rank, len(actions[rank])), f"no F for stage {s} mb {mb}")
            if ("B", s, mb) not in seen:
                raise _fail(actions, seen[("F", s, mb)], f"F of stage {s} mb {mb} has no B")
    if gap := vp.vocab_missing(actions, seen, m):
        raise _fail(actions, *gap)
    for side, other in (("SEND", "RECV"), ("RECV", "SEND")):
        for key, at in messages[side].items():
            if key not in messages[other]:
                raise _fail(actions, at, f"this {side} has no matching {other}")
    stuck = _run(actions, num_stages, per_rank=False, synchronous=False)
    if stuck:
        raise _stuck(actions, stuck, "dependencies cannot be met in list order")


def _stuck(
    actions: dict[int, list[Action]], stuck: dict[int, tuple[int, str]], what: str
) -> ScheduleError:
    rank = min(stuck)
    why = "; ".join(f"rank {r}: {w}" for r, (_, w) in stuck.items())
    return _fail(actions, (rank, stuck[rank][0]), f"{what}: {why}")


def dry_run(
    lowered: dict[int, list[Action]], placement: Placement, synchronous: bool = True
) -> None:
    """Execute the lowered lists in order with blocking receives and either rendezvous sends
    (synchronous: a send completes when its receiver reaches the RECV) or buffered sends; raise
    ScheduleError with the grid if the ranks deadlock or an action runs before its input."""
    stuck = _run(lowered, placement.num_stages, per_rank=True, synchronous=synchronous)
    if stuck:
        mode = "rendezvous" if synchronous else "buffered"
        raise _stuck(lowered, stuck, f"deadlock with {mode} sends")
