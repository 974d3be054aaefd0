"""Every idle second of every rank attributed to what it waited for.

    result = attribute_idle(Lanes.of(trace.events), steps)

A rank's idle time in a step is its step row less its F, B and W rows: the intervals between
them, and before the first and after the last. Each interval is cut by the main-thread rows
inside it (lanes.MAIN) and every piece goes to one cause:

- late sender: a receive blocked until its message's send ended: the sending rank and the
  action whose output it carried ("rank 0 F3 of stage 0");
- hop: the rest of a blocked receive, from the send's end to the receive's end (the message);
- gradient all-reduce: the wait, after the pipeline, for the gradient buckets (grad_wait);
- step boundary: time before the rank's first action and after its last one that no row
  covers (the step's start, its metrics, the end-of-step wait for every send);
- own runtime: the rest (posting sends, receives whose message was there, the loop between
  actions).

The pieces tile each interval, so the causes add up to the measured idle of every rank.
"""

from __future__ import annotations

import numpy as np

from mpihybrid.analysis.lanes import COMPUTE_CODES, Lanes, action_name, waited
from mpihybrid.trace.recorder import KIND

CAUSES = ("late sender", "hop", "gradient all-reduce", "step boundary", "own runtime")


def attribute_idle(lanes: Lanes, steps: list[int]) -> dict:
    """{"ranks": [{rank, idle (measured), causes {cause: s}, senders {"rank 0 F3 of stage 0":
    s}, attributed}], "steps": n}: seconds summed over `steps` (0-based)."""
    out: dict[int, dict] = {}
    for step in steps:
        for rank in lanes.ranks(step):
            row = out.setdefault(
                rank,
                {"rank": rank, "idle": 0.0, "causes": dict.fromkeys(CAUSES, 0.0), "senders": {}},
            )
            _one(lanes, step, rank, row)
    ranks = []
    for rank in sorted(out):
        row = out[rank]
        row["attributed"] = sum(row["causes"].values())
        row["senders"] = dict(sorted(row["senders"].items(), key=lambda kv: -kv[1])[:8])
        ranks.append(row)
    return {"ranks": ranks, "steps": len(steps)}


def _one(lanes: Lanes, step: int, rank: int, out: dict) -> None:
    ev = lanes.events
    begin, finish = lanes.window(step, rank)
    rows = lanes.rows(step, rank)
    compute = rows[np.isin(ev["kind"][rows], COMPUTE_CODES)]
    ends, starts = ev["end"][compute], ev["start"][compute]
    busy = float(np.sum(np.clip(ends, begin, finish) - np.clip(starts, begin, finish)))
    out["idle"] += max(0.0, finish - begin - busy)
    # the idle intervals: between the compute rows, and before the first / after the last
    edges = [begin, *np.ravel(np.column_stack([ev["start"][compute], ev["end"][compute]])), finish]
    first = float(ev["start"][compute[0]]) if len(compute) else finish
    last = float(ev["end"][compute[-1]]) if len(compute) else finish
    others = rows[~np.isin(ev["kind"][rows], COMPUTE_CODES)]
    for a, b in zip(edges[0::2], edges[1::2], strict=True):
        a, b = max(a, begin), min(b, finish)
        if b > a:
            _interval(lanes, others, a, b, first=first, last=last, out=out)


def _interval(lanes, others, a: float, b: float, *, first: float, last: float, out: dict) -> None:
    """Cut [a, b] by the rows in it and give each piece to its cause."""
    ev = lanes.events
    causes = out["causes"]
    inside = others[(ev["end"][others] > a) & (ev["start"][others] < b)]
    cursor = a

    def uncovered(upto: float) -> None:
        if upto <= cursor:
            return
        # outside every action: the step's edges, or the rank's own loop between actions
        before = min(upto, first) - cursor if cursor < first else 0.0
        after = upto - max(cursor, last) if upto > last else 0.0
        edge = max(0.0, before) + max(0.0, after)
        causes["step boundary"] += edge
        causes["own runtime"] += (upto - cursor) - edge

    for i in inside[np.argsort(ev["start"][inside], kind="stable")]:
        s, e = max(float(ev["start"][i]), cursor), min(float(ev["end"][i]), b)
        if e <= cursor:
            continue
        uncovered(s)
        cursor = max(cursor, s)
        code = int(ev["kind"][i])
        send = lanes.sender.get(int(i))
        if code == KIND["recv"] and waited(ev, int(i), send):
            sent = min(max(float(ev["end"][send]), cursor), e)
            who = f"rank {int(ev['rank'][send])} {_producer(lanes, send)}"
            out["senders"][who] = out["senders"].get(who, 0.0) + sent - cursor
            causes["late sender"] += sent - cursor
            causes["hop"] += e - sent
        elif code == KIND["grad_wait"]:
            causes["gradient all-reduce"] += e - cursor
        else:
            causes["own runtime"] += e - cursor
        cursor = e
    uncovered(b)


def _producer(lanes: Lanes, send: int) -> str:
    """The action whose output a send carried: "F3 of stage 0"."""
    ev = lanes.events
    return action_name(lanes.carried[send], int(ev["stage"][send]), int(ev["microbatch"][send]))
