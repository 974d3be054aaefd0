"""Does a long run's memory grow with its steps? Python's allocations (tracemalloc) and the
resident set (VmRSS) after N, 2N and 3N steps of one run, per step between them.

    python benchmarks/soak_growth.py --steps 2000 --set trace.path=runs/soak.h5 \
        --set trace.overwrite=true

One process (MPI's singleton: no mpiexec), a tiny model so that steps are cheap; the growth per
step between the marks is what a million-step run would multiply. Counts, not times: the figures
do not depend on the machine's speed. Prints one JSON line with --json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from mpihybrid.config import load_job  # noqa: E402
from mpihybrid.train import loop  # noqa: E402
from mpihybrid.train.memory import proc_kib  # noqa: E402

TINY = ["model.hidden=8", "model.depth=2", "train.log_every=0", "trace.flush_steps=100"]


def soak(steps: int, overrides: list[str], python: bool = True) -> dict:
    """One run of 4 x steps; Python's allocated bytes and VmRSS at each mark, and the largest
    growth per step between two marks, with the allocation sites that grew most. python=False:
    VmRSS alone (tracemalloc's own records grow the resident set with every live allocation)."""
    # one step past the last mark: the run's end (its last flush, its report) is not measured
    job = load_job(None, [*TINY, f"train.steps={4 * steps + 1}", *overrides], 1)
    marks: dict[int, tuple] = {}
    step_once = loop._train_step

    def step(job, world, run, record, s, **kwargs):
        step_once(job, world, run, record, s, **kwargs)
        if (s + 1) % steps == 0:
            gc.collect()
            snap = tracemalloc.take_snapshot() if python else None
            marks[s + 1] = (snap, proc_kib("/proc/self/status", "VmRSS"))

    loop._train_step = step
    if python:
        tracemalloc.start(1)
    try:
        loop.train(job, MPI.COMM_WORLD, quiet=True)
    finally:
        loop._train_step = step_once
        tracemalloc.stop()
    out = {"steps": steps, "python_bytes_per_step": [], "rss_bytes_per_step": [], "sites": []}
    for a, b in ((steps, 2 * steps), (2 * steps, 3 * steps), (3 * steps, 4 * steps)):
        stats = marks[b][0].compare_to(marks[a][0], "lineno") if python else []
        out["python_bytes_per_step"].append(sum(st.size_diff for st in stats) / steps)
        out["rss_bytes_per_step"].append((marks[b][1] - marks[a][1]) / steps)
        out["sites"] += [f"{st.size_diff / steps:.1f} B/step {st.traceback}" for st in stats[:3]
                         if st.size_diff > 0]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000, help="steps between two marks")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rss-only", action="store_true", help="no tracemalloc")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = soak(args.steps, args.overrides, python=not args.rss_only)
    if args.json:
        print(json.dumps(out))
        return
    for i, (py, rss) in enumerate(
        zip(out["python_bytes_per_step"], out["rss_bytes_per_step"], strict=True)
    ):
        a, b = (i + 1) * args.steps, (i + 2) * args.steps
        print(f"steps {a} -> {b}: Python {py:+.1f} B/step, VmRSS {rss:+.1f} B/step")
    print("\n".join(out["sites"]))


if __name__ == "__main__":
    main()
