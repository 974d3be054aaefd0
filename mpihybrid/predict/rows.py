"""What a change of M does to a micro-batch's cost, for whatif's replay (analysis/replay.py).
Not linear in the rows: a layer call's fixed cost and its weights' traffic stay. Where the
trace timed each chunk's passes at two row counts (train/row_probe.py), the line through them,
the host's own; else predict's cost model of each stage at the new rows against the run's (the
packaged `local` cluster: a shape calibrated on another machine). Either way only the shape is
taken; the trace's measured costs are what it scales.

    rows = probed_factors(probe, m_run=4, m_new=8, units=2)            # {"F": [...], ...} | None
    rows = row_factors(trace_config_toml, m_run=4, m_new=8, units=2)   # {"F": [...], ...} | None
    change = costed(base, change)          # a whatif Change with its rows, as the command runs it
"""

from __future__ import annotations

import dataclasses

from mpihybrid.config import ConfigError, build_job, tomllib
from mpihybrid.nn.cost import stage_work
from mpihybrid.predict.cluster import find_cluster, load_cluster
from mpihybrid.predict.model import action_seconds

ROW_MODEL = "local"  # the packaged cluster whose cost model gives the shape


def row_factors(
    config: str, m_run: int, m_new: int, units: int, cluster: str = ROW_MODEL
) -> dict[str, list[float]] | None:
    """Per kind (F, B, W), each of the `units` stages' cost of a micro-batch at M = m_new
    against M = m_run; None where the job (the trace's TOML) cannot be read or its stages are
    not the trace's (the replay is then linear in the rows)."""
    try:
        job = build_job(tomllib.loads(config or ""))
        then = stage_work(job.workload)
        train = dataclasses.replace(job.train, microbatches=m_new)
        now = stage_work(dataclasses.replace(job, train=train).workload)
        model = load_cluster(find_cluster(cluster))
    except (ConfigError, tomllib.TOMLDecodeError, ValueError, TypeError, KeyError, OSError):
        return None
    if len(then) != units or len(now) != units:
        return None
    out = {}
    for kind in "FBW":
        was = [action_seconds(w, kind, model) for w in then]
        out[kind] = [
            action_seconds(w, kind, model) / x if x > 0 else m_run / m_new
            for w, x in zip(now, was, strict=True)
        ]
    return out


def probed_factors(probe, m_run: int, m_new: int, units: int) -> dict[str, list[float]] | None:
    """Per kind, each of the `units` chunks' cost of a micro-batch at M = m_new against M =
    m_run, on the line through the trace's two timings of it (probe: (row_probe_rows,
    row_probe_s)); None where the probe is not of these chunks. A line that falls with the rows
    (noise) or would cost less than nothing at no rows is taken through zero (linear)."""
    (rows, other), seconds = probe
    if len(seconds) != 6 * units or rows == other:
        return None
    new_rows = rows * m_run / m_new
    out: dict[str, list[float]] = {k: [] for k in "FBW"}
    for unit in range(units):
        for p, kind in enumerate("FBW"):
            at_rows, at_other = seconds[6 * unit + 2 * p], seconds[6 * unit + 2 * p + 1]
            slope = (at_rows - at_other) / (rows - other)
            fixed = at_rows - slope * rows
            if at_rows <= 0 or slope <= 0 or fixed < 0:
                out[kind].append(m_run / m_new)
            else:
                out[kind].append((fixed + slope * new_rows) / at_rows)
    return out


def merge_ratios(probe, m_run: int, m_new: int, units: int) -> list[float] | None:
    """Per chunk, what each further micro-batch adds to a merged W (train.merge_w) as a fraction
    of one W, at M = m_new: on the line through the probe's two W timings a pass costs fixed +
    slope x rows, and a merged one pays `fixed` once (the gather of the rows not counted); None
    where the probe is not of these chunks. A line that falls with the rows (noise) or costs
    less than nothing at no rows saves nothing: 1."""
    (rows, other), seconds = probe
    if len(seconds) != 6 * units or rows == other:
        return None
    new_rows = rows * m_run / m_new
    out = []
    for unit in range(units):
        at_rows, at_other = seconds[6 * unit + 4], seconds[6 * unit + 5]
        slope = (at_rows - at_other) / (rows - other)
        fixed = at_rows - slope * rows
        ok = at_rows > 0 and slope > 0 and fixed >= 0
        out.append(slope * new_rows / (fixed + slope * new_rows) if ok else 1.0)
    return out


def costed(base, change):
    """`change` (analysis.replay.Change) on `base` (its Measured) with a change of M costed by
    the trace's row probe, else row_factors, and a merged W's by the probe (merge_ratios), as
    the whatif command replays it; unchanged without a change of M or of merge_w."""
    if change.merge_w and change.merge_w > 1 and base.row_probe is not None:
        units, m = base.costs[0][0].units, change.microbatches or base.m
        change = dataclasses.replace(
            change, merge_ratios=merge_ratios(base.row_probe, base.m, m, units)
        )
    if not change.microbatches:
        return change
    units = base.costs[0][0].units
    rows = None
    if base.row_probe is not None:
        rows = probed_factors(base.row_probe, base.m, change.microbatches, units)
    if rows is None:
        rows = row_factors(base.config, base.m, change.microbatches, units)
    return dataclasses.replace(change, rows=rows)
