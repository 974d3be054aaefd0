"""What a change of M does to a micro-batch's cost, for whatif's replay (analysis/replay.py):
predict's cost model of each stage at the new rows against the run's. Not linear in the rows: a
layer call's fixed cost and its weights' traffic stay. Only the shape is taken from the model
(the packaged `local` cluster by default); the trace's measured costs are what it scales.

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


def costed(base, change):
    """`change` (analysis.replay.Change) on `base` (its Measured) with a change of M costed by
    row_factors, as the whatif command replays it; unchanged without a change of M."""
    if not change.microbatches:
        return change
    units = base.costs[0][0].units
    return dataclasses.replace(
        change, rows=row_factors(base.config, base.m, change.microbatches, units)
    )
