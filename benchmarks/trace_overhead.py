"""What tracing costs: the same job with every event recorded, with only one row per step, and
with every event written to a trace file flushed every --flush-steps steps (each flush gathers
the events to rank 0 and republishes the file: copy, append, fsync, rename), alternating in one
launch so all modes see the same machine.

    mpiexec -n 4 python benchmarks/trace_overhead.py jobs/laptop.toml --repeats 5 --flush-steps 10

Prints the median step time of each mode, their ratios and the mean time of one flush (rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile

import numpy as np
from mpi4py import MPI

from mpihybrid.config import load_job
from mpihybrid.trace.read import load
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
    parser.add_argument("--flush-steps", type=int, default=10, help="steps between flushes")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    job = load_job(args.job, args.overrides, world.Get_size())
    folder = world.bcast(tempfile.mkdtemp() if world.rank == 0 else None, root=0)
    path = os.path.join(folder, "trace.h5")
    modes = {
        "events": {"events": True},
        "step rows only": {"events": False},
        f"file, flushed every {args.flush_steps}": {
            "events": True, "path": path, "overwrite": True, "flush_steps": args.flush_steps,
            "flush_seconds": 0.0,
        },
    }  # fmt: skip
    times = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode, settings in modes.items():
            run = dataclasses.replace(job, trace=dataclasses.replace(job.trace, **settings))
            summary = train(run, world, quiet=True)
            if summary is not None:
                events = load(path).events if "path" in settings else summary.events
                times[mode].append(median_step_time(events))
    if world.rank == 0:
        steps = job.train.steps
        print(f"job {args.job}: {world.Get_size()} ranks, {steps} steps x {args.repeats}")
        base = statistics.median(times["events"])
        for mode, values in times.items():
            median = statistics.median(values)
            print(f"{mode:24s} {1e3 * median:8.3f} ms/step  x{median / base:.4f}")
        file_mode = list(modes)[-1]
        extra = (statistics.median(times[file_mode]) - base) * steps
        flushes = max(1, (steps - 1) // args.flush_steps)
        print(f"flush cost             ~{1e3 * extra / flushes:8.3f} ms per flush (step time)")


if __name__ == "__main__":
    main()
