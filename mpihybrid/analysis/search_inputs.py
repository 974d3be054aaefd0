"""The inputs of a schedule search that come from a run or a job: a trace's measured per-stage
costs, whether a trace is of the job in front of it, a memory limit in bytes as micro-batches.

    costs = trace_costs(trace, "runs/zbv.h5")     # pipeline.search_costs.SearchCosts, checked
    each = [trace_costs(trace, step=s) for s in measured_steps(trace)]   # step by step
    check_job(costs, trace, job, "runs/zbv.h5")   # CostsError unless the same model and pp
    k = inflight_for_bytes(job, 2 * 1024**3)       # micro-batches of a rank's share
"""

from __future__ import annotations

import math

from mpihybrid.pipeline.search_costs import CostsError, SearchCosts, check_values


def trace_costs(
    trace, path: str = "the trace", skip_steps: int = 1, step: int | None = None
) -> SearchCosts:
    """A run's measured per-stage costs (analysis.costs.stage_costs over its measured steps, or
    that one step (0-based), the mean message hop): the split it ran with, fixed."""
    import numpy as np

    from mpihybrid.analysis.costs import stage_costs
    from mpihybrid.analysis.messages import message_latency
    from mpihybrid.pipeline.placement import Placement
    from mpihybrid.trace.recorder import COMPUTE, KIND, VOCAB

    if not trace.has_actions:
        raise CostsError(f"{path}: a trace with trace.events = false has no per-action costs")
    placement = Placement.from_attrs(trace.attrs)
    events = trace.events
    # with the receives: an F or B that waited inside its row for the vocabulary shares'
    # parts starts after them (costs.with_shares)
    compute = events[np.isin(events["kind"], [*COMPUTE, *VOCAB, KIND["recv"]])]
    steps = measured_steps(trace, skip_steps) if step is None else [step]
    compute = compute[np.isin(compute["step"], steps)]
    send = message_latency(events[np.isin(events["step"], steps)], mean=True)
    measured = stage_costs(compute, placement.num_stages, send)
    split = any(w > 0 for w in measured["weight"])
    forward, backward, weight = measured["forward"], measured["backward"], measured["weight"]
    if not split:  # whole backwards only: B is the whole one, W unknown
        backward, weight = measured["whole"], [0.0] * len(forward)
    return check_values(
        SearchCosts(
            tuple(forward),
            tuple(backward),
            tuple(weight),
            send=float(send),
            gap=float(measured["gap"]),
            tail=tuple(measured["tail"]),
            whole=tuple(measured["whole"]),
            fixed=True,
            can_split=split,
            source=path,
            stage_ranks=placement.stage_ranks,
            partition=_trace_partition(trace),
            vocab=tuple(tuple(v) for v in (measured["vocab"] or {}).values()),
        )
    )


def measured_steps(trace, skip_steps: int = 1) -> list[int]:
    """The steps (0-based) trace_costs averages over: each one's own costs, trace_costs(step=)."""
    import numpy as np

    from mpihybrid.analysis.metrics import _measured_steps
    from mpihybrid.trace.recorder import COMPUTE

    events = trace.events
    compute = events[np.isin(events["kind"], list(COMPUTE))]
    return [int(s) for s in _measured_steps(compute, skip_steps)]


def _trace_partition(trace) -> tuple[int, ...]:
    from mpihybrid.config import tomllib

    try:
        model = tomllib.loads(trace.config or "").get("model", {})
    except tomllib.TOMLDecodeError:
        return ()
    part = model.get("partition")
    return tuple(int(c) for c in part) if isinstance(part, list) else ()


_SAME = {"model": None, "data": None}  # sections that must agree (partition apart)


def check_job(costs: SearchCosts, trace, job, path: str) -> None:
    """CostsError unless the trace is of this job's model, data, micro-batch size and pp."""
    from mpihybrid.config import to_toml, tomllib

    try:
        theirs = tomllib.loads(trace.config or "")
    except tomllib.TOMLDecodeError as exc:
        raise CostsError(f"{path}: its job text does not parse ({exc})") from None
    mine = tomllib.loads(to_toml(job))
    for section in _SAME:
        a = {k: v for k, v in theirs.get(section, {}).items() if k != "partition"}
        b = {k: v for k, v in mine.get(section, {}).items() if k != "partition"}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                raise CostsError(
                    f"{path} is a run of another model: {section}.{key} = {a.get(key)!r} there, "
                    f"{b.get(key)!r} in this job"
                )
    pp = int(trace.attrs.get("pp", 0))
    if pp != job.grid.pp:
        raise CostsError(f"{path} ran at pp={pp}, this job runs pp={job.grid.pp}")
    rows = _mb_rows(theirs)
    if rows is not None and rows != job.train.global_batch // (
        job.grid.dp * job.train.microbatches
    ):
        raise CostsError(
            f"{path} ran micro-batches of {rows} samples, this job's have "
            f"{job.train.global_batch // (job.grid.dp * job.train.microbatches)}"
        )


def _mb_rows(doc: dict) -> int | None:
    t, g = doc.get("train", {}), doc.get("grid", {})
    try:
        return int(t["global_batch"]) // (int(g.get("dp", 1)) * int(t["microbatches"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def inflight_for_bytes(job, nbytes: int) -> float:
    """The memory limit `nbytes` per rank as micro-batches of a rank's share (train/memory's
    model of the job under 1F1B: what a rank holds besides activations, and one micro-batch's
    activations on its stage; the tightest rank). CostsError naming the smallest limit that
    holds one micro-batch."""
    import dataclasses

    from mpihybrid.pipeline.plan import make_schedule
    from mpihybrid.pipeline.simulate import peak_per_rank
    from mpihybrid.train.memory import rank_estimate

    job = dataclasses.replace(job, train=dataclasses.replace(job.train, schedule="1f1b"))
    pp, m = job.grid.pp, job.train.microbatches
    plain = make_schedule("1f1b", pp, m)  # as its paper draws it
    peaks = peak_per_rank(plain.lists(), plain.placement)
    fits, smallest = math.inf, 0.0
    for r in range(pp):
        parts = rank_estimate(job, r)
        per_mb = parts["activations"] / max(peaks[r], 1)
        rest = sum(parts.values()) - parts["activations"]
        smallest = max(smallest, rest + per_mb)
        fits = min(fits, (nbytes - rest) / per_mb if per_mb else math.inf)
    if fits < 1:
        from mpihybrid.units import human_bytes

        raise CostsError(
            f"--memory {human_bytes(nbytes, 1)}: no schedule fits; a rank needs at least "
            f"{human_bytes(smallest, 1)} (its state and one micro-batch in flight)"
        )
    return math.floor(fits * 2) / 2 if fits < math.inf else float(pp)
