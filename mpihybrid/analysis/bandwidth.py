"""The all-reduce's bandwidth from a trace's `allreduce` rows, as nccl-tests reports it.

    rows = allreduce_bandwidth(trace.kind("allreduce"), stage_params, dp, sharded)

One row per stage and phase: an all-reduce, or (train.shard_optimizer) the gradient
reduce-scatter and the weight all-gather, each with the bus bandwidth of its own ring.
"""

from __future__ import annotations

import numpy as np

from mpihybrid.analysis.rows import durations, group_min, group_sum, groups

# bus bandwidth per algorithm bandwidth of a ring of n (nccl-tests' PERFORMANCE.md): an
# all-reduce moves 2(n-1)/n of the vector over each link, a reduce-scatter or all-gather (n-1)/n
PHASES = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1}


def allreduce_bandwidth(
    rows: np.ndarray, params: list[int] | None, n: int, sharded: bool = False
) -> list[dict]:
    """nccl-tests figures per stage and phase: size = the fp32 vector, algbw = size / time,
    busbw = algbw * k(n-1)/n (PHASES); time = the mean over steps of the sum over the stage's
    buckets (the microbatch column; -1 in traces from before buckets) of each ring's shortest
    duration. Sharded (train.shard_optimizer): a bucket's two rows, the gradient reduce-scatter
    and the weight all-gather, are two phases. A bucket that overlapped compute shares the core
    with it: its bandwidth reads low."""
    if not sharded:
        return _phase_bandwidth(rows, params, n, "all-reduce")
    # a rank's two rows of a bucket: the reduce-scatter starts first (the gather starts when
    # the update after it ends)
    _, group = groups(rows["rank"], rows["step"], rows["stage"], rows["microbatch"])
    order = np.lexsort((rows["start"], group))
    first = np.r_[True, group[order][1:] != group[order][:-1]]
    halves = [("reduce-scatter", rows[order[first]]), ("all-gather", rows[order[~first]])]
    out = [row for phase, half in halves for row in _phase_bandwidth(half, params, n, phase)]
    return sorted(out, key=lambda row: row["stage"])  # stable: each stage's phases in order


def _phase_bandwidth(rows: np.ndarray, params: list[int] | None, n: int, phase: str) -> list[dict]:
    out = []
    # a ring finishes together: the last rank to arrive waits least, so the shortest duration
    # of one call is the collective's own time (nccl-tests times after a barrier)
    calls, call_of = groups(rows["stage"], rows["step"], rows["microbatch"])
    shortest = group_min(call_of, durations(rows), len(calls))
    stage_steps, step_of = groups(calls[:, 0], calls[:, 1])  # (stage, step): its buckets
    per_step = group_sum(step_of, shortest, len(stage_steps))
    rank_calls, _ = groups(rows["stage"], rows["step"], rows["rank"])
    wire = group_sum(rows["stage"] - rows["stage"].min(), rows["bytes"], 0) if len(rows) else []
    for s in np.unique(rows["stage"]):
        seconds = float(per_step[stage_steps[:, 0] == s].mean())
        calls = int(np.sum(rank_calls[:, 0] == s))  # one rank's reduction of one step
        wire_bytes = float(wire[s - rows["stage"].min()])
        size = 4 * params[s] if params is not None else None
        algbw = size / seconds if size is not None and seconds > 0 else None
        out.append(
            {
                "stage": int(s),
                "phase": phase,
                "ranks": n,
                "size_bytes": size,
                "seconds": seconds,
                "algbw": algbw,
                "busbw": algbw * PHASES[phase] * (n - 1) / n if algbw is not None else None,
                "wire_bytes": wire_bytes / calls,  # one rank, one step
            }
        )
    return out
