"""How evenly this host's cores run: one process pinned to each core does the same fixed
matrix product over and over for SECONDS, and reports its rate each INTERVAL; the table gives,
per interval, the slowest core's time for the product against the fastest's. On a machine whose
cores run alike the ratio stays near 1; where it passes the straggler rule's threshold
(pipeline/slowdown.py THRESHOLD) a healthy run's ranks differ by that much, and analyze is right
to name the slower one: its core is slower (docs/analysis.md, Stragglers).

    flock -x /tmp/mh_heavy.lock python benchmarks/core_speeds.py [--seconds 30] [--interval 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

N = 192  # a product of about 1.4 MFLOP: thousands per interval, in a core's L2


def _worker(core: int, seconds: float, interval: float, start: float, out) -> None:
    os.sched_setaffinity(0, {core})
    import numpy as np

    a = np.random.default_rng(core).standard_normal((N, N)).astype(np.float32)
    b, c = a.copy(), np.empty_like(a)
    while time.time() < start:
        pass
    rates, t, cpu = [], time.perf_counter(), time.thread_time()
    end = t + seconds
    while t < end:
        n, until = 0, t + interval
        while time.perf_counter() < until:
            np.matmul(a, b, out=c)
            n += 1
        now, cpu_now = time.perf_counter(), time.thread_time()
        rates.append(((now - t) / n, (cpu_now - cpu) / n))  # seconds a product: wall, CPU
        t, cpu = now, cpu_now
    out.put((core, rates))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cores = sorted(os.sched_getaffinity(0))
    out = mp.get_context("fork").Queue()
    start = time.time() + 1.0
    procs = [
        mp.get_context("fork").Process(
            target=_worker, args=(c, args.seconds, args.interval, start, out)
        )
        for c in cores
    ]
    for p in procs:
        p.start()
    got = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    n = min(len(r) for r in got.values())
    from mpihybrid.pipeline.slowdown import THRESHOLD

    def spread(i: int, k: int) -> float:  # k = 0: wall clock, 1: the thread's CPU time
        times = [got[c][i][k] for c in cores]
        return max(times) / min(times)

    ratios = [(spread(i, 0), spread(i, 1)) for i in range(n)]
    print(f"{len(cores)} cores, {n} intervals of {args.interval:g} s, a {N}x{N} fp32 product")
    print(
        "interval  "
        + "  ".join(f"core {c} wall/CPU (us)" for c in cores)
        + "  slowest/fastest wall  CPU"
    )
    for i in range(n):
        row = "  ".join(f"{1e6 * got[c][i][0]:9.1f} {1e6 * got[c][i][1]:9.1f}" for c in cores)
        print(f"{i:8d}  {row}  {ratios[i][0]:21.2f} {ratios[i][1]:4.2f}")
    for k, what in enumerate(("wall clock", "CPU time")):
        r = [x[k] for x in ratios]
        over = sum(x >= THRESHOLD for x in r)
        print(
            f"slowest/fastest core, {what}: median {statistics.median(r):.2f}, max {max(r):.2f}; "
            f">= {THRESHOLD:g} (the straggler threshold) in {over} of {n} intervals"
        )


if __name__ == "__main__":
    main()
