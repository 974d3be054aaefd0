"""The vocabulary passes of model.vocab_parallel as actions of the schedule (nn/vocab.py's math).

    lists = add_vocab_passes(compute, placement, m, costs, simulate)   # E, S, T, G on every rank

Every rank r runs, for every micro-batch mb, four passes on its share of the vocabulary (the
action's stage is the share, = r): `rE mb` its part of the token embedding (to the first stage's
rank), `rS mb` its partial logits and softmax statistics from the last stage's output (sent to it
by that stage's F), `rT mb` the loss's gradient from every share's statistics: the share's weight
gradient and its part of the last stage's input gradient (to that rank), `rG mb` its rows of the
table's gradient from the first stage's input gradient. Their messages go with them (receives
posted when the step begins, sends that never wait), so they order nothing but their inputs:

    F(0, mb) <- E(r, mb) for every r      S(r, mb) <- F(last, mb)
    T(r, mb) <- S(r', mb) for every r'    B(last, mb) <- T(r, mb) for every r
    G(r, mb) <- B(0, mb)

The E passes open each rank's list and the G passes close it (cheap gathers and scatter-adds);
S and T are placed on every rank by the one simulator (pipeline/simulate.py): S of mb before the
first action that would start after the last stage's F of mb ends, T before the first that would
start after the last S of mb ends, both before the rank's first backward of mb. The placement is
Yeung et al.'s idea (MLSys 2025: S and T where each rank has time for them) reached by list
scheduling instead of their hand-built blocks, so it applies to any list: 1F1B, V-Half, auto's.
"""

from __future__ import annotations

from collections.abc import Mapping

from mpihybrid.pipeline.actions import Action

VOCAB_KINDS = ("E", "S", "T", "G")


def has_vocab(actions: Mapping[int, list[Action]] | list[Action]) -> bool:
    """Whether these lists (rank -> list, or one list) carry vocabulary passes."""
    lists = actions.values() if isinstance(actions, Mapping) else [actions]
    return any(a.kind in VOCAB_KINDS for acts in lists for a in acts)


def vocab_inputs(a: Action, last: int, pp: int) -> list[tuple[str, int, int]]:
    """What `a` waits for beyond the pipeline's own inputs, as (kind, stage or share, mb), where
    the lists carry vocabulary passes."""
    s, mb = a.stage, a.microbatch
    if a.kind == "S":
        return [("F", last, mb)]
    if a.kind == "T":
        return [("S", r, mb) for r in range(pp)]
    if a.kind == "G":
        return [("B", 0, mb)]
    if a.kind == "F" and s == 0:
        return [("E", r, mb) for r in range(pp)]
    if a.kind == "B" and s == last:
        return [("T", r, mb) for r in range(pp)]
    return []


def vocab_problem(a: Action, rank: int, m: int, seen: Mapping) -> str:
    """What is wrong with vocabulary pass `a` at `rank` (validate), or ""."""
    if a.stage != rank:
        return f"{a}: share {a.stage}'s pass runs on rank {a.stage}"
    if not 0 <= a.microbatch < m:
        return f"{a} is outside micro-batches 0..{m - 1}"
    if (a.kind, a.stage, a.microbatch) in seen:
        return f"second {a.kind} pass of share {a.stage} micro-batch {a.microbatch}"
    before = {"T": "S"}.get(a.kind)
    if before and (before, a.stage, a.microbatch) not in seen:
        return f"{a} runs before its {before}"
    return ""


def vocab_missing(actions: Mapping[int, list[Action]], seen: Mapping, m: int):
    """Where lists with vocabulary passes lack one (validate): ((rank, step), why), or None."""
    if not has_vocab(actions):
        return None
    for r in sorted(actions):
        for mb in range(m):
            for k in VOCAB_KINDS:
                if (k, r, mb) not in seen:
                    return (r, len(actions[r])), f"no {k} pass of share {r} micro-batch {mb}"
    return None


def missing_input(a: Action, last: int, pp: int, made) -> tuple[str, int, int] | None:
    """The first of vocab_inputs(a) not yet `made` (the dry run: their messages are not
    actions, what they carry is there once made), or None."""
    return next((k for k in vocab_inputs(a, last, pp) if k not in made), None)


def key_rank(key: tuple[str, int, int], placement) -> int:
    """The rank that produces (kind, stage or share, mb)."""
    return key[1] if key[0] in VOCAB_KINDS else placement.rank_of(key[1])


def add_vocab_passes(
    compute: dict[int, list[Action]], placement, num_microbatches: int, costs, simulate
) -> dict[int, list[Action]]:
    """The compute lists with every rank's E, S, T and G passes placed (module docstring), the
    backwards deferred (defer_backwards: the last stage's by 0, 1 or 2 forwards, or every
    rank's by 1 or 2) as simulates fastest (within 1 %, the fewest deferred); costs:
    simulate.Costs with the vocabulary passes' seconds (Costs.vocab); simulate:
    pipeline.simulate.simulate (which imports this module)."""
    head = [placement.rank_of(placement.num_stages - 1)]
    # fewest micro-batches added in flight first: a deferral must gain over 1 % to be taken
    tries = [(head, d) for d in range(3)] + [(range(placement.pp), d) for d in (1, 2)]
    found = []
    for ranks, defer in tries:
        lists = defer_backwards(compute, ranks, defer)
        try:
            lists = _place(lists, placement, num_microbatches, costs, simulate)
            found.append((simulate(lists, placement, costs).makespan, lists))
        except ValueError:  # ScheduleError: this deferral deadlocks the lists
            continue
    if not found:
        raise ValueError("no placement of the vocabulary passes runs these lists")
    fastest = min(makespan for makespan, _ in found)
    return next(lists for makespan, lists in found if makespan <= 1.01 * fastest)


def defer_backwards(compute, ranks, defer: int) -> dict[int, list[Action]]:
    """The lists with every backward of `ranks` (a B, and its W where that came before the B's
    new place) moved past `defer` more of the rank's forwards: a backward that waits for every
    rank's T lets the rank run forwards meanwhile (Yeung et al. shift the backwards the same
    way; `defer` more micro-batches in flight)."""
    out = {r: list(acts) for r, acts in compute.items()}
    for r in ranks:
        acts, pending, forwards = [], [], 0  # pending: [release at, B, its W (or None)]
        for a in compute[r]:
            waiting = next((p for p in pending if p[1].stage == a.stage
                            and p[1].microbatch == a.microbatch), None)  # fmt: skip
            if a.kind == "B":
                pending.append([forwards + defer, a, None])
            elif a.kind == "W" and waiting is not None:
                waiting[2] = a  # its B is not placed yet: the W follows it
            else:
                acts.append(a)
                forwards += a.kind == "F"
            while pending and pending[0][0] <= forwards:
                acts.extend(x for x in pending.pop(0)[1:] if x is not None)
        for _, b, w in pending:
            acts.extend(x for x in (b, w) if x is not None)
        out[r] = acts
    return out


def _place(lists, placement, num_microbatches: int, costs, simulate) -> dict[int, list[Action]]:
    m, pp = num_microbatches, placement.pp
    last = placement.num_stages - 1
    lists = {
        r: [Action(r, "E", mb) for mb in range(m)]
        + list(lists[r])
        + [Action(r, "G", mb) for mb in range(m)]
        for r in range(pp)
    }

    def place(kind: str, mb: int, after: float, floor: dict[int, int]) -> None:
        start = simulate(lists, placement, costs).start
        for r in range(pp):
            acts = lists[r]
            pos = next(
                (i for i in range(floor[r], len(acts)) if start[acts[i]] >= after),
                len(acts),
            )
            # before every backward of mb: the last stage's waits for T (and a backward of mb
            # on this rank waits for that one)
            waits = (i for i, a in enumerate(acts) if a.kind in "BWG" and a.microbatch == mb)
            pos = min(pos, next(waits))
            acts.insert(max(pos, floor[r]), Action(r, kind, mb))

    for mb in range(m):
        result = simulate(lists, placement, costs)
        t_f = result.end[Action(last, "F", mb)]
        floor = {r: _after(lists[r], "T", mb - 1) for r in range(pp)}
        place("S", mb, t_f, floor)
        result = simulate(lists, placement, costs)
        t_s = max(result.end[Action(r, "S", mb)] for r in range(pp))
        place("T", mb, t_s, {r: _after(lists[r], "S", mb) for r in range(pp)})
    return lists


def _after(acts: list[Action], kind: str, mb: int) -> int:
    """The position just past this rank's `kind` pass of mb (0 for mb < 0)."""
    if mb < 0:
        return 0
    return next(i for i, a in enumerate(acts) if a.kind == kind and a.microbatch == mb) + 1
