"""`train.schedule = "auto"` in `mpihybrid predict`: the schedule searched on the cost model's
per-block times instead of times measured on this machine.

    job, line = predicted_auto(job, cluster)    # the job running csv:auto@HASH, its split

The cost model gives each block's F, B and W on the cluster's device (nn.cost.block_work,
predict.model.action_seconds) and the pipeline hop (predict.wire.message_seconds); the search
(pipeline/search.py, as `train` runs it: deterministic, train.schedule_inflight or its default
limit) splits the blocks and orders the actions; the job is then predicted as it would run,
the job carrying the searched CSV (config/searched.apply).
"""

from __future__ import annotations

import dataclasses
import json

from mpihybrid.config import Job
from mpihybrid.predict.cluster import Cluster


def block_costs(job: Job, cluster: Cluster):
    """SearchCosts of the job's blocks on `cluster` (one rank per core it shares, as predict)."""
    from mpihybrid.nn.cost import block_work, stage_work
    from mpihybrid.pipeline.search_costs import SearchCosts, check_values
    from mpihybrid.predict.cluster import shared_cores
    from mpihybrid.predict.model import action_seconds
    from mpihybrid.predict.wire import message_seconds

    cluster = shared_cores(cluster, job.grid.pp * job.grid.dp)
    blocks = block_work(job.workload)
    # the hop between neighbouring ranks as one-chunk-per-rank places them (every placement
    # searched sends the same activation between neighbours)
    loop = dataclasses.replace(
        job, train=dataclasses.replace(job.train, schedule="1f1b", virtual_stages=1)
    )
    full = job.train.recompute == "full"  # a backward first runs its forward again

    def seconds(kind: str) -> tuple[float, ...]:
        return tuple(action_seconds(w, kind, cluster) for w in blocks)

    forward = seconds("F")
    backward = tuple(b + (f if full else 0.0) for b, f in zip(seconds("B"), forward, strict=True))
    return check_values(
        SearchCosts(
            forward,
            backward,
            seconds("W"),
            send=message_seconds(loop, stage_work(loop.workload), cluster),
            source=f"the cost model on {cluster.name}",
        )
    )


def predicted_auto(job: Job, cluster: Cluster, time_limit: float | None = None):
    """(the job with "auto" replaced by the schedule searched on the predicted costs, a line
    saying what was found, the search's result); ScheduleError, one line, when the costs or
    the limit are bad. time_limit: the exact search's (deterministic; default train's)."""
    from mpihybrid.config.searched import AUTO_GAP, apply, auto_placements
    from mpihybrid.nn.model import layer_counts
    from mpihybrid.pipeline.search import csv_of, search

    t = job.train
    time_limit = t.schedule_time if time_limit is None else time_limit
    result = search(
        block_costs(job, cluster),
        job.grid.pp,
        t.microbatches,
        max_inflight=t.schedule_inflight or None,
        placements=auto_placements(t),
        time_limit=time_limit,
        exact=time_limit > 0,
        deterministic=True,
        gap_limit=AUTO_GAP,
    )
    best = result.best
    payload = {
        "csv": csv_of(result),
        "partition": layer_counts(job.model, best.ranges),
        "chunks": best.placement.chunks,
        "info": json.dumps({"placement": best.placement.style, "found_by": best.found_by}),
    }
    resolved = apply(job, payload, job.grid.pp * job.grid.dp)
    line = (
        f"train.schedule = auto: {best.placement.style} placement, "
        f"{[len(r) for r in best.ranges]} blocks per stage, by {best.found_by} ({result.status}), "
        f"at most {result.max_inflight:g} micro-batches of a rank's share per rank "
        f"(as {resolved.train.schedule})"
    )
    return resolved, line, result
