"""What simulate() needs of a run, measured from its trace rows (simulate.Costs).

    stage_costs(events, num_stages, send=message_latency(events))

Every figure the simulator uses is measured here by the rule the simulator applies it with, so a
trace laid out by simulate() gives its costs back and its bubble exactly (tests/test_analysis.py).
Pure numpy on the event rows, grouped (no mask per group).
"""

from __future__ import annotations

import numpy as np

from mpihybrid.analysis.rows import durations, group_max, group_sum, groups
from mpihybrid.trace.recorder import COMPUTE, KIND


def _find(table: list[np.ndarray], query: list[np.ndarray]) -> np.ndarray:
    """For each query key (a row of the query columns): the index of a table row with that key,
    -1 where none."""
    n = len(table[0])
    if n == 0 or len(query[0]) == 0:
        return np.full(len(query[0]), -1, dtype=np.int64)
    _, group = groups(*(np.concatenate([t, q]) for t, q in zip(table, query, strict=True)))
    row = np.full(int(group.max()) + 1, -1, dtype=np.int64)
    row[group[:n]] = np.arange(n)
    return row[group[n:]]


def _key(rows: np.ndarray, stage_shift: int = 0) -> list[np.ndarray]:
    """(step, replica, stage + stage_shift, micro-batch) of every row: a tensor's identity."""
    return [rows["step"], rows["replica"], rows["stage"] + stage_shift, rows["microbatch"]]


def _mean_per_stage(rows: np.ndarray, num_stages: int) -> np.ndarray:
    """Mean duration per stage; NaN where the stage has no row."""
    total = group_sum(rows["stage"], durations(rows), num_stages)
    count = np.bincount(rows["stage"], minlength=num_stages)[:num_stages]
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / count


def stage_costs(events: np.ndarray, num_stages: int, send: float = 0.0) -> dict:
    """What simulate() needs of a run, measured from its F/B/W rows (simulate.Costs):

    forward, backward, weight: mean seconds of one F, B, W per stage (0.0 where a stage has none);
        backward is the input gradient where the stage splits backwards, else a whole backward;
    whole: mean seconds of a whole backward (a B with no W: input and weight gradients);
        backward + weight where the stage has none;
    tail: how much longer the stage's last weight-gradient action of a step (its last W or whole
        B: actions.last_weight_actions) runs than the others of its kind: the gradient buckets'
        work done inside it (the means above leave those actions out, where others exist);
    gap: the mean time a rank spends between two compute actions when it waits for nothing
        (the next one's input was produced on the same rank, or at least `send` seconds before
        the previous one ended): posting sends, receives already there, tracing, Python.
    """
    rows = events[np.isin(events["kind"], list(COMPUTE)) & (events["stage"] >= 0)]
    rows = rows[rows["stage"] < num_stages]
    kind = rows["kind"]
    is_f, is_b, is_w = (kind == KIND[k] for k in ("forward", "backward", "weight"))
    # a B is whole when no W of its stage and micro-batch ran in that step
    whole = is_b & (_find(_key(rows[is_w]), _key(rows)) < 0)
    # the last weight-gradient action of each (step, replica, stage): the latest-starting W or
    # whole B
    candidates = np.flatnonzero(is_w | whole)
    last = np.zeros(len(rows), dtype=bool)
    if len(candidates):
        c = rows[candidates]
        _, group = groups(c["step"], c["replica"], c["stage"])
        latest = group_max(group, c["start"], int(group.max()) + 1)
        last[candidates[c["start"] == latest[group]]] = True

    def body_mean(mask: np.ndarray) -> np.ndarray:
        """Per stage: the mean over the rows that are not a last weight-gradient action, or over
        all of them where every one is (one micro-batch)."""
        body, every = (
            _mean_per_stage(rows[mask & ~last], num_stages),
            _mean_per_stage(rows[mask], num_stages),
        )
        return np.where(np.isnan(body), every, body)

    forward = np.nan_to_num(_mean_per_stage(rows[is_f], num_stages))
    split_b = _mean_per_stage(rows[is_b & ~whole], num_stages)
    whole_b = body_mean(whole)
    backward = np.nan_to_num(np.where(np.isnan(split_b), whole_b, split_b))
    weight = np.nan_to_num(body_mean(is_w))
    whole_b = np.where(np.isnan(whole_b), backward + weight, whole_b)
    tail = np.zeros(num_stages)
    for mask, base in ((is_w, weight), (whole, whole_b)):
        ends = rows[mask & last]
        extra = _mean_per_stage(ends, num_stages) - base
        # never below 0: a last action quicker than the mean of a few others is their spread
        tail = np.where(np.isnan(extra), tail, np.maximum(extra, 0.0))
    return {
        "forward": forward.tolist(),
        "backward": backward.tolist(),
        "weight": weight.tolist(),
        "whole": whole_b.tolist(),
        "tail": tail.tolist(),
        "gap": _idle_gap(rows, send),
    }


def _idle_gap(rows: np.ndarray, send: float) -> float:
    """stage_costs' gap: the mean time between two consecutive compute rows of a rank and step
    where the second waited for nothing (its input made on its rank, or at least `send` seconds
    before the first ended); 0.0 with no such pair."""
    order = np.lexsort((rows["start"], rows["step"], rows["rank"]))
    rows = rows[order]
    same = (rows["rank"][1:] == rows["rank"][:-1]) & (rows["step"][1:] == rows["step"][:-1])
    prev, nxt = rows[:-1][same], rows[1:][same]
    # the row whose output the next one consumes: F of s-1 (an F), B of s+1 (a B)
    producer = np.full(len(nxt), -1, dtype=np.int64)
    for name, shift in (("forward", -1), ("backward", 1)):
        mine = nxt["kind"] == KIND[name]
        made = np.flatnonzero(rows["kind"] == KIND[name])
        found = _find(_key(rows[made]), _key(nxt[mine], shift))
        producer[mine] = np.where(found >= 0, made[found], -1)
    remote = producer >= 0
    remote[remote] = rows["rank"][producer[remote]] != nxt["rank"][remote]
    ready = np.ones(len(nxt), dtype=bool)
    ready[remote] = rows["end"][producer[remote]] + send <= prev["end"][remote]
    gaps = nxt["start"][ready] - prev["end"][ready]
    return float(np.mean(gaps)) if len(gaps) else 0.0
