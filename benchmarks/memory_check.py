"""Does the pre-run memory check cover what a rank really peaks at? Measured against estimated.

    mpiexec -n 2 python benchmarks/memory_check.py --set model.hidden=3072 \
        --set train.optimizer=adamw --set train.global_batch=64

Runs `mpihybrid train`'s path on every rank: the job, then what the check sees (this rank's
resident set when it runs: already in the cgroup's usage), the check's estimate by part, then
the training (steps, evaluation, report's collectives, trace flush), and prints per rank: the
resident set at the check, the whole run's peak (VmHWM), the growth past the check (what the
estimate has to cover) and the estimate's total and ratio. A ratio >= 1 is a check that holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from mpihybrid.config import load_job  # noqa: E402
from mpihybrid.train.loop import train  # noqa: E402
from mpihybrid.train.memory import (  # noqa: E402
    load_kernels,
    peak_rss_bytes,
    proc_kib,
    rank_estimate,
)

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", nargs="?", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    job = load_job(args.job, args.overrides, world.size)
    pp_rank, _ = job.grid.layout.coords(world.rank)
    load_kernels(job)  # as check_fits does first
    at_check = proc_kib("/proc/self/status", "VmRSS")
    parts = rank_estimate(job, pp_rank, world.size == MPI.COMM_WORLD.Split_type(
        MPI.COMM_TYPE_SHARED).Get_size())  # fmt: skip
    train(job, world, quiet=True)
    row = {"rank": world.rank, "at_check": at_check, "peak": peak_rss_bytes(), "parts": parts}
    rows = world.gather(row, root=0)
    if world.rank != 0:
        return
    if args.json:
        print(json.dumps({"overrides": args.overrides, "ranks": rows}))
        return
    print("== " + " ".join(args.overrides))
    print("rank  at check  peak (VmHWM)  growth  estimate  estimate/growth")
    for r in rows:
        growth, need = r["peak"] - r["at_check"], sum(r["parts"].values())
        print(f"{r['rank']:4d}  {r['at_check'] / MIB:8.1f}  {r['peak'] / MIB:12.1f}  "
              f"{growth / MIB:6.1f}  {need / MIB:8.1f}  {need / max(growth, 1):15.3f}")  # fmt: skip
    for r in rows:
        print(
            f"rank {r['rank']}: " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in r["parts"].items())
        )
    total_growth = sum(r["peak"] - r["at_check"] for r in rows)
    total_need = sum(sum(r["parts"].values()) for r in rows)
    print(f"node: growth {total_growth / MIB:.1f} MiB, estimate {total_need / MIB:.1f} MiB, "
          f"ratio {total_need / total_growth:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
