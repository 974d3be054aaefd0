"""What a trace flush costs, before and after flushes wrote parts: the same job traced with one
flush at the end, with a flush every step that republishes the whole file (the writer before
issue #33: copy, append, fsync, rename; here MAX_PARTS = 0), and with a flush every step that
writes a part (merged at the end). The modes alternate in one launch, so all see the same
machine; prints each mode's median wall time of train(), its trace file's size and the bytes
rank 0 sent to storage (/proc/self/io write_bytes: the trace above all, copies included).

    mpiexec -n 2 python benchmarks/trace_flush.py --steps 1500 --repeats 3

Figures: docs/robustness.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

from mpi4py import MPI

from mpihybrid.config import load_job
from mpihybrid.trace import file as trace_file
from mpihybrid.train.loop import train

SMALL = ["model.hidden=16", "model.depth=4", "data.train_samples=1024", "data.test_samples=64"]


def write_bytes() -> int:
    """Bytes this process has caused to be sent to storage so far (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("write_bytes:"))
    except (OSError, StopIteration):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", nargs="?", default=None, help="job file (default: embedded)")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    overrides = [*SMALL, f"train.steps={args.steps}", *args.overrides]
    job = load_job(args.job, overrides, world.Get_size())
    folder = world.bcast(tempfile.mkdtemp() if world.rank == 0 else None, root=0)
    modes = {  # name: (flush_steps, MAX_PARTS)
        "one flush at the end": (0, trace_file.MAX_PARTS),
        "every step, whole file": (1, 0),
        "every step, parts": (1, trace_file.MAX_PARTS),
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    sizes: dict[str, int] = {}
    written: dict[str, list[int]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for i, (mode, (flush_steps, max_parts)) in enumerate(modes.items()):
            path = os.path.join(folder, f"mode{i}.h5")
            trace = dataclasses.replace(job.trace, path=path, overwrite=True,
                                        flush_steps=flush_steps, flush_seconds=0.0)  # fmt: skip
            trace_file.MAX_PARTS = max_parts
            world.Barrier()
            t0, w0 = time.perf_counter(), write_bytes()
            train(dataclasses.replace(job, trace=trace), world, quiet=True)
            world.Barrier()
            times[mode].append(time.perf_counter() - t0)
            written[mode].append(write_bytes() - w0)
            if world.rank == 0:
                sizes[mode] = os.path.getsize(path)
    if world.rank == 0:
        print(f"{world.Get_size()} ranks, {args.steps} steps, {args.repeats} repeats, "
              f"{' '.join(overrides)}")  # fmt: skip
        base = statistics.median(times["one flush at the end"])
        base_size = sizes["one flush at the end"]
        for mode in modes:
            median = statistics.median(times[mode])
            wrote = statistics.median(written[mode])
            print(
                f"{mode:24s} {median:8.2f} s  x{median / base:6.2f}   file {sizes[mode] / 1e6:8.2f}"
                f" MB  x{sizes[mode] / base_size:6.2f}   rank 0 wrote {wrote / 1e6:9.2f} MB"
            )
        old, new = (statistics.median(times[m]) for m in list(modes)[1:])
        print(f"whole file / parts: time x{old / new:.2f}")


if __name__ == "__main__":
    main()
