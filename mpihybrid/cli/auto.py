"""`train.schedule = "auto"`: a schedule searched for the job at the start, the same on every rank.

    job = resolve_auto(job, world)      # collective; ConfigError (the same on every rank)

Rank 0 takes the costs (the job's blocks timed here, each block's optimizer update, and the hop
and per-action gap pipeline ranks 0 and 1 measure running the runtime itself, cli/link_probe.py;
or `train.schedule_costs = RUN.h5`: a run of this model's measured per-stage costs, its split
kept), searches the split and the order under
the memory limit (`train.schedule_inflight` micro-batches of a rank's share, 0: pp) with
pipeline/search.py, deterministically (one solver worker, a deterministic time limit), and
broadcasts torch's CSV of the lists and the split. Every rank then runs the job as
`train.schedule = "csv:auto@HASH"` with that split: the job carries the CSV and the search's
record (config.searched.apply; its schedule value, pipeline/plan.py, takes them), so the trace
keeps the CSV (`schedule_csv`) like any csv: schedule's, and the costs and the prediction with
it (`schedule_search`, JSON; `analyze` prints measured against predicted). A resumed run keeps
the split of its newest checkpoint and searches only the order.

Blocks timed one after another in one process are not what a run pays: the ranks share the
machine's caches and memory bandwidth, and a stage's passes interleave with another's (on
jobs/gpt_bench.toml the head's backward ran 21 % faster in the run, the layers' 15-30 % slower;
docs/schedules.md). So, on the job's timed blocks, the first search's schedule runs
`train.schedule_calibrate` steps (every rank, traced to a temporary file, no checkpoint), each
block's F, B, W and tail are rescaled so that its stage sums to what the run measured
(search_costs.calibrated), and the order is searched again on them at the same split and
placement (carried to another split, a run's costs decided by less than two runs of one schedule
differ here). The schedule found is simulated on each measured step apart (`expected`: one
simulation of mean costs idles less than steps that differ from each other); where the order
changed, it runs its own calibration steps first, which predict it. The trace keeps both
predictions and the first search (`calibration`).
"""

from __future__ import annotations

import json
import os

from mpihybrid import temps
from mpihybrid.config import WARM
from mpihybrid.config.searched import AUTO_GAP, apply, auto_placements


def costs_of(job, link: tuple[float, float] = (0.0, 0.0)):
    """(SearchCosts, the partition setting to keep or None, the block ranges a kept split
    fixes or None): a trace's measured per-stage costs (train.schedule_costs), or the job's
    blocks timed here with `link` = (send, gap) cli.link_probe measured."""
    from mpihybrid.analysis.search_inputs import check_job, trace_costs
    from mpihybrid.pipeline.search_costs import job_costs
    from mpihybrid.train.partition import stored_counts

    t, m = job.train, job.model
    if t.schedule_costs:
        from mpihybrid.trace.read import load

        trace = load(t.schedule_costs)
        costs = trace_costs(trace, t.schedule_costs)
        check_job(costs, trace, job, t.schedule_costs)
        return costs, list(costs.partition) or trace_partition_setting(trace), None
    counts = stored_counts(job) or (m.partition if isinstance(m.partition, list) else None)
    return job_costs(job, link=link), None, block_ranges(m, counts) if counts else None


def decide(
    job,
    costs,
    *,
    partition=None,
    ranges=None,
    tick=None,
    calibration=None,
    each=(),
    placements=None,
) -> dict:
    """Rank 0's search on `costs` (costs_of): {"csv", "partition", "chunks", "info"} (raises
    CostsError, ScheduleError with one line). calibration: what the costs were calibrated on,
    kept in the info; each: the per-stage costs of each calibration step at the split kept
    (`ranges`), on which the schedule found is simulated for its expected bubble and pipeline
    phase (_expected). placements: those searched (default: auto_placements')."""
    from mpihybrid.nn.model import layer_counts
    from mpihybrid.pipeline.search import csv_of, search

    t = job.train
    result = search(
        costs,
        job.grid.pp,
        t.microbatches,
        max_inflight=t.schedule_inflight or None,
        placements=placements or auto_placements(t),
        ranges=ranges,
        time_limit=t.schedule_time,
        exact=t.schedule_time > 0,
        deterministic=True,
        gap_limit=AUTO_GAP,
        tick=tick,
    )
    best = result.best
    if partition is None:
        partition = layer_counts(job.model, best.ranges)
    sim = best.sim
    info = {
        "placement": best.placement.style,
        "found_by": best.found_by,
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
    if calibration:
        info["calibration"] = calibration
    if each:
        on = "the calibration run's steps, each at this split"
        info["expected"] = _expected(best.lists, best.placement, each, on)
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
    from mpihybrid.config import AUTO

    if job.train.schedule != AUTO:
        return job
    from mpihybrid.cli.link_probe import probe_link

    size = world.Get_size() if world is not None else job.grid.pp * job.grid.dp
    # the hop and the gap as the runtime pays them (collective; a trace's costs have their own)
    link = probe_link(world, job) if not job.train.schedule_costs else (0.0, 0.0)
    mine = {}  # rank 0's: the costs the first search ran on

    def first():
        costs, partition, ranges = costs_of(job, link)
        mine.update(costs=costs)
        return decide(job, costs, partition=partition, ranges=ranges, tick=tick)

    payload = _agreed(world, first)
    steps = job.train.schedule_calibrate
    if not steps or job.train.schedule_costs or world is None or job.grid.pp < 2:
        return apply(job, payload, size)
    # the searched schedule runs a few steps; what its stages paid rescales the blocks' costs
    # (search_costs.calibrated) and the order is searched again on them, at the same split and
    # placement (a run's costs are of its split: carried to another, they decide by less than
    # the runs differ from each other)
    searched_job = apply(job, payload, size)
    path = calibration_run(searched_job, world, steps)

    def again():
        from mpihybrid.pipeline.search import make_placement
        from mpihybrid.pipeline.search_costs import calibrated

        source = f"{steps} steps of the first search's schedule"
        run, each = _measured(path, source)
        searched = block_ranges(job.model, payload["partition"])
        first_info = json.loads(payload["info"])
        note = {
            "steps": steps,
            "split": [len(r) for r in searched],
            "placement": first_info["placement"],
            "found_by": first_info["found_by"],
            "makespan": first_info["makespan"],
            "bubble": first_info["bubble"],
        }
        style = first_info["placement"]
        if len(searched) != make_placement(style, job.grid.pp).num_stages:
            # interleaved's loop of 2 pp stages: no order is searched for it; its steps predict it
            expected = _expected_of_job(searched_job, each)
            return {**payload, "info": json.dumps(first_info | {"calibration": note,
                                                                "expected": expected})}  # fmt: skip
        costs = calibrated(mine["costs"], searched, run)
        return decide(job, costs, ranges=searched, tick=tick, calibration=note, each=each,
                      placements=(style,))  # fmt: skip

    found = _agreed(world, again)
    _give_back()  # the solver's heap too, before the run builds its model
    if found["csv"] == payload["csv"]:  # the same lists: its own steps predicted it
        return apply(job, found, size)
    # another schedule or split: it runs its own steps, and they predict it (its costs move with
    # the order too: a stage's W beside another stage's passes is not the same W)
    resolved = apply(job, found, size)
    path = calibration_run(resolved, world, steps)

    def own():
        info = json.loads(found["info"])
        info["expected"] = expected_of_run(resolved, path, f"{steps} steps of the schedule found")
        return {**found, "info": json.dumps(info)}

    return apply(job, _agreed(world, own), size)


def expected_of_run(job, path: str, source: str) -> dict:
    """The job's schedule simulated on each measured step of its own traced run at `path`
    (removed after): the bubble and pipeline phase that run's steps predict (_expected)."""
    return _expected_of_job(job, _measured(path, source)[1])


def _expected_of_job(job, each) -> dict:
    """_expected of the job's own schedule (as resolved) on a run of it."""
    return _expected(job.schedule.lists(), job.schedule.placement, each, "its own calibration run")


def _measured(path: str, source: str):
    """(the mean per-stage costs, each measured step's) of the calibration trace at `path` past
    its WARM first steps, which is then removed with its directory."""
    from mpihybrid.analysis.search_inputs import measured_steps, trace_costs
    from mpihybrid.trace.read import load

    try:
        trace = load(path)
        return trace_costs(trace, source, WARM), [
            trace_costs(trace, source, step=s) for s in measured_steps(trace, WARM)
        ]
    finally:
        temps.remove(os.path.dirname(path))


def _expected(lists, placement, each, on: str) -> dict:
    """The mean bubble and pipeline phase of the lists simulated once on each of `each`
    (per-stage costs of one measured step, trace_costs(step=)): a run's steps differ, and a rank
    slower in one step than its mean idles the others, so one simulation of mean costs predicts
    less idle time than the steps have (analyze's per-step prediction says the same)."""
    from mpihybrid.pipeline.simulate import simulate

    sims = [simulate(lists, placement, c.split([range(i, i + 1) for i in range(c.units)]))
            for c in each]  # fmt: skip
    return {
        "steps": len(sims),
        "bubble": sum(x.bubble_fraction for x in sims) / len(sims),
        "makespan": sum(x.makespan for x in sims) / len(sims),
        "on": on,
    }


def calibration_run(job, world, steps: int) -> str:
    """`steps` steps of the job as resolved (no checkpoint, evaluation or step lines), traced to
    a temporary file rank 0 writes: its path (rank 0's; "" elsewhere). Collective."""
    import dataclasses

    from mpihybrid.config import TraceConfig
    from mpihybrid.train.loop import train

    path = _agreed(world, lambda: os.path.join(temps.make_dir("mpihybrid-auto-"), "calibration.h5"))
    t = dataclasses.replace(job.train, steps=steps, eval_every=0, log_every=0)
    # the job's checkpoint.dir stays: a SIGTERM or SIGUSR1 then means what it means to the job
    # (preempted before step 1, exit 3); train(calibrating=True) writes no checkpoint there
    keep = dataclasses.replace(job.checkpoint, every=0)
    run = dataclasses.replace(job, train=t, trace=TraceConfig(path=path), checkpoint=keep)
    try:
        train(run, world, quiet=True, calibrating=True)
    except BaseException as exc:
        if path:  # its flight records too: the error's line must not point into it
            temps.remove(os.path.dirname(path))
            vars(exc).pop("flight_record", None)
        raise
    _give_back()
    return path if world.rank == 0 else ""


def _give_back() -> None:
    """Freed memory back to the system (glibc keeps the heap a calibration run or a solve grew:
    without this a gpt_bench rank's peak grew from 454 to 640 MiB); elsewhere nothing."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _agreed(world, decide_on_rank0):
    """decide_on_rank0() on rank 0, its payload on every rank; its one-line error raised as a
    ConfigError on every rank alike."""
    from mpihybrid.comm.agree import rank0_decides
    from mpihybrid.config import ConfigError
    from mpihybrid.pipeline.actions import ScheduleError
    from mpihybrid.trace.read import TraceError

    expected = (ScheduleError, TraceError, OSError, ValueError)
    payload, error = rank0_decides(world, decide_on_rank0, expected=expected)
    if error:
        raise ConfigError(f"train.schedule = 'auto': {error}")
    return payload
