"""What per-action tracing costs: the same job with every event recorded and with only one row
per step, alternating in one launch so both see the same machine.

    mpiexec -n 4 python benchmarks/trace_overhead.py jobs/laptop.toml --repeats 5

Prints the median step time of each mode and their ratio (rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy as np
from mpi4py import MPI

from mpihybrid.config import load_job
from mpihybrid.trace.recorder import KIND
from mpihybrid.train.loop import train


def median_step_time(events: np.ndarray, skip: int = 1) -> float:
    """Per step, first start to last end over all ranks; median over steps after `skip`."""
    rows = events[events["kind"] == KIND["step"]]
    times = [
        rows["end"][rows["step"] == s].max() - rows["start"][rows["step"] == s].min()
        for s in np.unique(rows["step"])[skip:]
    ]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", nargs="?", default="jobs/laptop.toml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    job = load_job(args.job, args.overrides, world.Get_size())
    times = {True: [], False: []}
    for _ in range(args.repeats):
        for events in (True, False):
            run = dataclasses.replace(job, trace=dataclasses.replace(job.trace, events=events))
            summary = train(run, world, quiet=True)
            if summary is not None:
                times[events].append(median_step_time(summary.events))
    if world.rank == 0:
        traced, untraced = statistics.median(times[True]), statistics.median(times[False])
        print(f"job {args.job}: {world.Get_size()} ranks, {job.train.steps} steps x {args.repeats}")
        print(f"step time traced    {1e3 * traced:8.3f} ms (median of {args.repeats} runs)")
        print(f"step time untraced  {1e3 * untraced:8.3f} ms")
        print(f"traced / untraced   {traced / untraced:8.4f}")


if __name__ == "__main__":
    main()
