"""`train.schedule = "auto"`: a schedule searched for the job at the start, the same on every rank.

    job = resolve_auto(job, world)      # collective; ConfigError (the same on every rank)

Rank 0 takes the costs (the job's blocks timed here, each block's optimizer update, and the hop
and per-action gap pipeline ranks 0 and 1 measure running the runtime itself, cli/link_probe.py;
or `train.schedule_costs = RUN.h5`: a run of this model's measured per-stage costs, its split
kept), searches the split and the order under
the memory limit (`train.schedule_inflight` micro-batches of a rank's share, 0: pp) with
pipeline/search.py, deterministically (one solver worker, a deterministic time limit), and
broadcasts torch's CSV of the lists and the split. Every rank then runs the job as
`train.schedule = "csv:auto@HASH"` with that split: the CSV is registered in this process
(csv_schedule.register), so the trace keeps it (`schedule_csv`) like any csv: schedule, and the
costs and the prediction go with it (`schedule_search`, JSON; `analyze` prints measured against
predicted). A resumed run keeps the split of its newest checkpoint and searches only the order.
"""

from __future__ import annotations

import json

from mpihybrid.config.searched import AUTO_TIME, apply, auto_placements


def decide(job, tick=None, link: tuple[float, float] = (0.0, 0.0)) -> dict:
    """Rank 0's search: {"csv", "partition", "chunks", "info"} (raises CostsError, ScheduleError,
    TraceError, OSError with one line). link: (send, gap) cli.link_probe measured, added to
    the job's timed blocks (a trace's costs carry their own)."""
    from mpihybrid.analysis.search_inputs import check_job, trace_costs
    from mpihybrid.nn.model import layer_counts
    from mpihybrid.pipeline.search import csv_of, search
    from mpihybrid.pipeline.search_costs import job_costs
    from mpihybrid.train.partition import stored_counts

    t, m = job.train, job.model
    ranges, partition = None, None
    if t.schedule_costs:
        from mpihybrid.trace.read import load

        trace = load(t.schedule_costs)
        costs = trace_costs(trace, t.schedule_costs)
        check_job(costs, trace, job, t.schedule_costs)
        partition = list(costs.partition) or trace_partition_setting(trace)
    else:
        costs = job_costs(job, link=link)
        counts = stored_counts(job) or (m.partition if isinstance(m.partition, list) else None)
        if counts is not None:
            ranges = block_ranges(job.model, counts)
    limit = t.schedule_inflight or None
    result = search(
        costs,
        job.grid.pp,
        t.microbatches,
        max_inflight=limit,
        placements=auto_placements(t),
        ranges=ranges,
        time_limit=AUTO_TIME,
        deterministic=True,
        tick=tick,
    )
    best = result.best
    if partition is None:
        partition = layer_counts(job.model, best.ranges)
    sim = best.sim
    info = {
        "placement": best.placement.style,
        "found_by": best.how,
        "status": result.status,
        "makespan": sim.makespan,
        "bubble": sim.bubble_fraction,
        "bound": result.bound,
        "step_bound": result.step_bound,
        "peak_per_rank": sim.peak_per_rank,
        "max_inflight": result.max_inflight,
        "costs": costs.as_dict(),
        "builtins": [{k: v for k, v in r.items()} for r in result.table],
    }
    return {
        "csv": csv_of(result),
        "partition": partition,
        "chunks": best.placement.chunks,
        "info": json.dumps(info),
    }


def trace_partition_setting(trace):
    """The trace's model.partition as its job said it ("cost", "uniform")."""
    from mpihybrid.config import tomllib

    return tomllib.loads(trace.config or "").get("model", {}).get("partition", "cost")


def block_ranges(model, counts: list[int]) -> list[range]:
    """The block ranges of a list of layer counts (layer_counts' inverse)."""
    from mpihybrid.nn.kinds import model_kind

    kind = model_kind(model.kind)
    sizes = list(counts)
    sizes[0] += len(kind.lead)
    sizes[-1] += len(kind.trail)
    out, at = [], 0
    for n in sizes:
        out.append(range(at, at + n))
        at += n
    return out


def resolve_auto(job, world=None, tick=None):
    """The job with "auto" replaced by the searched schedule (any other: as it is). Collective
    over `world` (None: this process alone). ConfigError, the same on every rank, when the
    costs are bad or no schedule meets the limit."""
    from mpihybrid.config import AUTO, ConfigError

    if job.train.schedule != AUTO:
        return job
    from mpihybrid.cli.link_probe import probe_link

    error, payload = None, None
    # the hop and the gap as the runtime pays them (collective; a trace's costs have their own)
    link = probe_link(world, job) if not job.train.schedule_costs else (0.0, 0.0)
    if world is None or world.rank == 0:
        error, payload = _decide_one_line(job, tick, link)
    if world is not None:
        error, payload = world.bcast((error, payload), root=0)
    if error:
        raise ConfigError(f"train.schedule = 'auto': {error}")
    return apply(job, payload, world.Get_size() if world is not None else job.grid.pp * job.grid.dp)


def _decide_one_line(job, tick, link) -> tuple[str | None, dict | None]:
    from mpihybrid.pipeline.actions import ScheduleError
    from mpihybrid.trace.read import TraceError

    try:
        return None, decide(job, tick, link)
    except (ScheduleError, TraceError, OSError, ValueError) as exc:
        return str(exc).splitlines()[0], None
