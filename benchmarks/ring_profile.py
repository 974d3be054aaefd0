"""Where one rank's time goes in the ring all-reduce: cProfile of rank 0 over repeated calls.

    mpiexec -n 2 python benchmarks/ring_profile.py --size 16M --codec int8 [--transport mpi]

Each rank all-reduces (sum) the same random vector `--repeats` times after `--warmup` calls;
rank 0 prints the wall time of each call and the functions that took the most time (the codec
kernels by name; time the ring spends waiting on its neighbour shows as the ring's own time,
since MPI's waits are C calls cProfile does not list).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
from mpi4py import MPI

from mpihybrid.cli.bench import parse_size
from mpihybrid.comm.allreduce import RingAllreduce
from mpihybrid.comm.codecs import CODECS, get_codec
from mpihybrid.comm.settings import TRANSPORTS, RingSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16M", help="float32 bytes, e.g. 16M")
    parser.add_argument("--codec", default="int8", choices=CODECS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--transport", default="auto", choices=TRANSPORTS)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    count = parse_size(args.size) // 4
    x = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
    ring = RingAllreduce(comm, count, RingSettings(get_codec(args.codec), transport=args.transport))
    flat = x.copy()
    for _ in range(args.warmup):  # numba compiles (or loads its cache) here
        flat[:] = x
        ring(flat, "sum")
    profile, walls = cProfile.Profile(), []
    for _ in range(args.repeats):
        flat[:] = x
        comm.Barrier()
        start = time.perf_counter()
        profile.enable()
        ring(flat, "sum")
        profile.disable()
        walls.append(time.perf_counter() - start)
    if comm.rank == 0:
        what = f"{args.codec} ring ({args.transport}), {args.size} on {comm.size} ranks"
        print(f"{what}: ms per call", end=" ")
        print([round(1e3 * w, 1) for w in walls])
        pstats.Stats(profile).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
