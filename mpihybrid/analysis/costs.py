"""What simulate() needs of a run, measured from its trace rows (simulate.Costs).

    stage_costs(events, num_stages, send=message_latency(events))

Every figure the simulator uses is measured here by the rule the simulator applies it with, so a
trace laid out by simulate() gives its costs back and its bubble exactly (tests/test_analysis.py).
Pure numpy on the event rows, grouped (no mask per group).
"""

from __future__ import annotations

import numpy as np

from mpihybrid.analysis.rows import durations, group_max, group_sum, groups
from mpihybrid.trace.recorder import COMPUTE, KIND, VOCAB

CODE = {letter: code for code, letter in (COMPUTE | VOCAB).items()}


def find_rows(table: list[np.ndarray], query: list[np.ndarray]) -> np.ndarray:
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


def pp_ranks(events: np.ndarray) -> np.ndarray:
    """Each row's pp rank: its rank's place among its replica's ranks (both grid orders number a
    replica's ranks in pp order); a vocabulary pass's share."""
    if not len(events):
        return np.zeros(0, dtype=np.int64)
    pairs, which = groups(events["replica"], events["rank"])  # (replica, rank) in key order
    first = np.searchsorted(pairs[:, 0], pairs[:, 0])  # the replica's first pair
    return (np.arange(len(pairs)) - first)[which]


def with_shares(events: np.ndarray) -> np.ndarray:
    """The rows as the analysis reads a model.vocab_parallel run: each vocabulary pass's stage
    (-1 in the trace) set to its share (pp_ranks), and an F or B that waited inside its row for
    the shares' parts (the first stage's F for the embedding's, the last stage's B for the
    head's gradient's: its first work) starting when its last such receive ended, so its row
    is its own work and the wait a receive before it, as the passes' own rows are."""
    is_vocab = np.isin(events["kind"], list(VOCAB))
    if not is_vocab.any():
        return events  # no copy: the rows are only read
    out = events.copy()
    out["stage"][is_vocab] = pp_ranks(out)[is_vocab]
    recv = np.flatnonzero((out["kind"] == KIND["recv"]) & (out["stage"] < 0))
    comp = np.flatnonzero(np.isin(out["kind"], list(COMPUTE)))
    if not len(recv) or not len(comp):
        return out
    # each receive's latest-starting compute row of its rank (ranks set apart by the span)
    base, span = out["start"].min(), out["end"].max() - out["start"].min() + 1.0
    at = out["start"][comp] - base + out["rank"][comp] * span
    comp, at = comp[np.argsort(at)], np.sort(at)
    i = np.searchsorted(at, out["start"][recv] - base + out["rank"][recv] * span, "right") - 1
    host = comp[np.maximum(i, 0)]
    inside = (i >= 0) & (out["rank"][host] == out["rank"][recv])
    inside &= out["end"][host] > out["end"][recv]  # inside, not one ending as it ends
    np.maximum.at(out["start"], host[inside], out["end"][recv[inside]])
    return out


def ran_lists(events: np.ndarray) -> dict | None:
    """The compute lists (pp rank -> Actions, vocabulary passes too) as the first step and
    replica of these rows ran them, each rank's rows in start order (a rank runs its list in
    order, the same every step): a model.vocab_parallel run's lists, whose passes were placed on
    timed costs no schedule name rebuilds; None with no vocabulary pass among the rows."""
    from mpihybrid.pipeline.actions import Action

    letters = COMPUTE | VOCAB
    rows = events[np.isin(events["kind"], list(letters))]
    if not np.isin(rows["kind"], list(VOCAB)).any():
        return None
    rows = with_shares(rows[(rows["step"] == rows["step"].min()) & (rows["replica"] == 0)])
    ranks = pp_ranks(rows)
    lists: dict[int, list] = {}
    for i in np.lexsort((rows["start"], ranks)):
        a = Action(int(rows["stage"][i]), letters[int(rows["kind"][i])], int(rows["microbatch"][i]))
        lists.setdefault(int(ranks[i]), []).append(a)
    return lists


def vocab_costs(rows: np.ndarray) -> dict | None:
    """model.vocab_parallel's passes, per share (rows: with_shares'): {"E", "S", "T", "G": mean
    seconds, "tail": how much longer a share's last G of a step runs than its others (the
    share's gradient ring and optimizer update run inside it)}; None with no such rows."""
    rows = rows[np.isin(rows["kind"], list(VOCAB))]
    if not len(rows):
        return None
    n = int(rows["stage"].max()) + 1
    out = {k: np.nan_to_num(_mean_per_stage(rows[rows["kind"] == CODE[k]], n)) for k in "EST"}
    g = rows[rows["kind"] == CODE["G"]]
    last = np.zeros(len(g), dtype=bool)
    if len(g):
        _, group = groups(g["step"], g["replica"], g["stage"])
        latest = group_max(group, g["start"], int(group.max()) + 1)
        last = g["start"] == latest[group]
    every, body = _mean_per_stage(g, n), _mean_per_stage(g[~last], n)
    out["G"] = np.nan_to_num(np.where(np.isnan(body), every, body))
    out["tail"] = np.maximum(np.nan_to_num(_mean_per_stage(g[last], n) - out["G"]), 0.0)
    return {k: v.tolist() for k, v in out.items()}


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
        the previous one ended): posting sends, receives already there, tracing, Python;
    vocab: model.vocab_parallel's passes per share (vocab_costs), None without them.
    """
    events = with_shares(events)
    everything = events[np.isin(events["kind"], list(COMPUTE | VOCAB)) & (events["stage"] >= 0)]
    rows = events[np.isin(events["kind"], list(COMPUTE)) & (events["stage"] >= 0)]
    rows = rows[rows["stage"] < num_stages]
    kind = rows["kind"]
    is_f, is_b, is_w = (kind == KIND[k] for k in ("forward", "backward", "weight"))
    # a B is whole when no W of its stage and micro-batch ran in that step
    whole = is_b & (find_rows(_key(rows[is_w]), _key(rows)) < 0)
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
        "gap": _idle_gap(everything, send, num_stages),
        "vocab": vocab_costs(everything),
    }


def _idle_gap(rows: np.ndarray, send: float, num_stages: int) -> float:
    """stage_costs' gap: the mean time between two consecutive compute rows of a rank and step
    where the second waited for nothing (every input of it made on its rank, or at least `send`
    seconds before the first ended); 0.0 with no such pair."""
    order = np.lexsort((rows["start"], rows["step"], rows["rank"]))
    rows = rows[order]
    same = (rows["rank"][1:] == rows["rank"][:-1]) & (rows["step"][1:] == rows["step"][:-1])
    prev, nxt = rows[:-1][same], rows[1:][same]
    latest = np.full(len(nxt), -np.inf)  # the end of its latest input made on another rank
    for mask, letter, stage in _inputs(nxt, num_stages, rows):
        made = np.flatnonzero(rows["kind"] == CODE[letter])
        want = nxt[mask]
        key = [want["step"], want["replica"], np.broadcast_to(stage, len(nxt))[mask]]
        found = find_rows(_key(rows[made]), [*key, want["microbatch"]])
        mine, producer = np.flatnonzero(mask)[found >= 0], made[found[found >= 0]]
        remote = rows["rank"][producer] != nxt["rank"][mine]
        np.maximum.at(latest, mine[remote], rows["end"][producer[remote]])
    ready = latest + send <= prev["end"]
    gaps = nxt["start"][ready] - prev["end"][ready]
    return float(np.mean(gaps)) if len(gaps) else 0.0


def _inputs(nxt: np.ndarray, num_stages: int, rows: np.ndarray):
    """(which of nxt, the letter of an input they wait for, its stage or share) of every input
    of the rows (simulate's and vocab_passes.vocab_inputs' dependencies)."""
    kind, stage, last = nxt["kind"], nxt["stage"], num_stages - 1
    out = [(kind == CODE["F"], "F", stage - 1), (kind == CODE["B"], "B", stage + 1)]
    vocab = rows[np.isin(rows["kind"], list(VOCAB))]
    for share in range(int(vocab["stage"].max()) + 1 if len(vocab) else 0):
        out += [
            ((kind == CODE["F"]) & (stage == 0), "E", share),
            ((kind == CODE["B"]) & (stage == last), "T", share),
            (kind == CODE["T"], "S", share),
        ]
    if len(vocab):
        out += [(kind == CODE["S"], "F", last), (kind == CODE["G"], "B", 0)]
    return out
