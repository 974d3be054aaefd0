"""Two runs diffed action by action: per (rank, stage, kind) the count and mean duration of
each, and which changes explain the step-time difference, through the replay.

    doc = diff(trace_a, trace_b, "a.h5", "b.h5")
    diff_lines(doc)

The attribution puts B's costs into A's run one at a time (each stage's F, B, W, or each
rank's where dp > 1, then the hop), each on top of the ones before, so the steps add up to the
replay of A with all of B's costs; the time outside the pipeline phase (the step's start, its
metrics, the gradient wait) is its own item. What is left (the two replays' own errors, the
gap between actions, the optimizer's tail) is the residual.
"""

from __future__ import annotations

import numpy as np

from mpihybrid.analysis.replay import Change, Measured, ReplayError, replay
from mpihybrid.analysis.rows import durations, group_sum, groups
from mpihybrid.trace.recorder import KIND, KINDS
from mpihybrid.units import table

ROW_KINDS = ("forward", "backward", "weight", "send", "recv", "grad_wait")
LETTERS = {"forward": "F", "backward": "B", "weight": "W"}


def action_table(events: np.ndarray, steps: list[int]) -> dict:
    """{(rank, stage, kind): (count per step, mean seconds)} over `steps`."""
    kept = np.isin(events["kind"], [KIND[k] for k in ROW_KINDS])
    rows = events[np.isin(events["step"], steps) & kept]
    if not len(rows):
        return {}
    keys, of = groups(rows["rank"], rows["stage"], rows["kind"])
    total = group_sum(of, durations(rows), len(keys))
    count = np.bincount(of, minlength=len(keys))
    n = max(len(steps), 1)
    return {
        (int(r), int(s), KINDS[int(k)]): (count[i] / n, total[i] / count[i])
        for i, (r, s, k) in enumerate(keys.tolist())
    }


def diff(trace_a, trace_b, path_a: str, path_b: str) -> dict:
    """The per-action table and the replay attribution (None, with a note, when the runs'
    layouts differ or a trace cannot be replayed)."""
    try:
        a, b = Measured.of(trace_a, path_a), Measured.of(trace_b, path_b)
    except ReplayError as exc:
        return {"rows": [], "attribution": None, "note": str(exc)}
    ta, tb = action_table(trace_a.events, a.steps), action_table(trace_b.events, b.steps)
    rows = []
    for key in sorted(set(ta) | set(tb)):
        (ca, ma), (cb, mb) = ta.get(key, (0, None)), tb.get(key, (0, None))
        change = mb / ma - 1 if ma and mb is not None else None
        rows.append(
            {"rank": key[0], "stage": key[1], "kind": key[2], "count_a": ca, "count_b": cb,
             "mean_a": ma, "mean_b": mb, "change": change}
        )  # fmt: skip
    same = (a.schedule, a.pp, a.dp, a.m, a.v) == (b.schedule, b.pp, b.dp, b.m, b.v)
    if not same:
        note = "the runs differ in schedule, grid or M: no attribution by replay"
        return {"rows": rows, "attribution": None, "note": note}
    return {"rows": rows, "attribution": _attribute(a, b, ta, tb), "note": None}


def _attribute(a: Measured, b: Measured, ta: dict, tb: dict) -> dict:
    scales: dict = {}
    items = []
    now = replay(a, Change())["step"]
    start = now
    for key, ratio in _ratios(a, b, ta, tb):
        scales[key] = ratio
        after = replay(a, Change(scales=dict(scales)))["step"]
        items.append({"what": _name(key), "ratio": ratio, "seconds": after - now})
        now = after
    items.append({"what": "outside the pipeline phase", "ratio": None,
                  "seconds": b.overhead - a.overhead})  # fmt: skip
    measured = float(np.mean(b.step_time) - np.mean(a.step_time))
    explained = now - start + b.overhead - a.overhead
    items.sort(key=lambda i: -abs(i["seconds"]))
    return {
        "measured_a": float(np.mean(a.step_time)),
        "measured_b": float(np.mean(b.step_time)),
        "measured": measured,
        "explained": explained,
        "residual": measured - explained,
        "items": items,
    }


def _ratios(a: Measured, b: Measured, ta: dict, tb: dict):
    """(scale key, B's mean / A's) per stage and kind (dp = 1) or rank and kind, then the hop."""
    out: dict = {}
    for (rank, stage, kind), (_, mean_a) in ta.items():
        letter = LETTERS.get(kind)
        if letter is None or (rank, stage, kind) not in tb or not mean_a:
            continue
        key = ("stage", stage, letter) if a.dp == 1 else ("rank", rank, letter)
        out.setdefault(key, []).append(tb[(rank, stage, kind)][1] / mean_a)
    pairs = [(k, float(np.mean(v))) for k, v in sorted(out.items())]
    for key, field in (("hop", "send"), ("gap", "gap"), ("tail", "tail")):
        mean_a = np.mean([np.sum(getattr(c, field)) for per in a.costs for c in per])
        mean_b = np.mean([np.sum(getattr(c, field)) for per in b.costs for c in per])
        if mean_a > 0:
            pairs.append((key, float(mean_b / mean_a)))
    return pairs


def _name(key) -> str:
    if isinstance(key, str):
        return {"hop": "the hop", "gap": "the gap between actions",
                "tail": "the optimizer's tail"}[key]  # fmt: skip
    where, i, kind = key
    return f"{where} {i} {kind}"


def diff_lines(doc: dict, labels: list[str]) -> list[str]:
    """The per-action table and the attribution, as text."""
    lines = ["", f"actions, per step (A = {labels[0]}, B = {labels[1]}; means in ms)"]
    rows = [
        [str(r["rank"]), str(r["stage"]), r["kind"], f"{r['count_a']:g}", f"{r['count_b']:g}",
         _ms(r["mean_a"]), _ms(r["mean_b"]),
         "-" if r["change"] is None else f"{r['change']:+.1%}"]
        for r in doc["rows"]
    ]  # fmt: skip
    lines += table(["rank", "stage", "kind", "n A", "n B", "mean A", "mean B", "change"], rows,
                   left=(2,))  # fmt: skip
    att = doc["attribution"]
    if att is None:
        return [*lines, f"attribution     {doc['note']}"]
    share = att["residual"] / att["measured"] if att["measured"] else 0.0
    lines += [
        "",
        f"why B's step differs: {1e3 * att['measured']:+.2f} ms measured "
        f"({1e3 * att['measured_a']:.2f} -> {1e3 * att['measured_b']:.2f} ms); B's costs put "
        f"into A's run one at a time (replayed) explain {1e3 * att['explained']:+.2f} ms, "
        f"residual {1e3 * att['residual']:+.2f} ms ({share:.0%} of the difference, "
        f"{att['residual'] / att['measured_a']:+.1%} of A's step)",
    ]
    items = [
        [i["what"], "-" if i["ratio"] is None else f"{i['ratio']:.3f}x",
         f"{1e3 * i['seconds']:+.2f}"]
        for i in att["items"] if abs(i["seconds"]) >= 1e-5
    ]  # fmt: skip
    return [*lines, *table(["cost", "B / A", "step ms"], items)]


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.3f}"
