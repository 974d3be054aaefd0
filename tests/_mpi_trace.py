"""Trace under MPI: clock offsets, gather_events, write/load on rank 0.

    mpiexec -n 4 python -m mpi4py tests/_mpi_trace.py /tmp/run.h5

Rank 0 prints one line `RESULT {json}` that tests/test_trace.py checks.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

from mpihybrid.trace.file import write_trace
from mpihybrid.trace.read import load
from mpihybrid.trace.recorder import KINDS, Recorder, clock_offset, gather_events


def num_events(rank: int) -> int:
    # rank 1 records nothing (an empty Gatherv block); the others outgrow capacity=4
    return 0 if rank == 1 else 3 + 5 * rank


def main(out_path: str) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    rec = Recorder(rank, replica=rank % 2, capacity=4)
    offset = clock_offset(comm)
    # the run's start on rank 0's clock, taken before any event
    origin = comm.bcast(rec.clock() if rank == 0 else None, root=0)

    for i in range(num_events(rank)):
        start = rec.clock()
        rec.record(
            i % len(KINDS), i, rank, 10 * i + rank, start, start + 1e-3, 1000 * rank + i, 0, 1e-4
        )
    local = rec.events.copy()
    local["start"] += offset
    local["end"] += offset

    raw = gather_events(comm, rec, offset)  # on rank 0's clock
    relative = gather_events(comm, rec, offset - origin)  # seconds since the run's start
    offsets = comm.gather(offset, root=0)
    expected = comm.gather(local, root=0)
    hostnames = comm.gather(MPI.Get_processor_name(), root=0)
    if rank != 0:
        assert raw is None and relative is None
        return

    order = np.lexsort((raw["step"], raw["rank"]))
    starts = raw["start"]
    write_trace(
        out_path,
        events=relative,
        steps={"loss": np.linspace(2.0, 1.0, 5)},
        config='[grid]\npp = 2\ndp = 2\n[train]\nschedule = "1f1b"\n',
        attrs={"world_size": size, "hostnames": hostnames},
    )
    trace = load(out_path)
    result = {
        "rows_per_rank": np.bincount(raw["rank"], minlength=size).tolist(),
        "offsets": offsets,
        "match_local": bool(np.array_equal(raw[order], np.concatenate(expected))),
        "sorted": bool(np.all(np.diff(starts) >= 0)),
        "min_start": float(relative["start"].min()) if len(relative) else 0.0,
        "relative_is_shifted_raw": bool(
            np.allclose(relative["start"], raw["start"] - origin, rtol=0, atol=1e-9)
        ),
        "loaded_equal": bool(np.array_equal(trace.events, relative)),
        "loaded_world_size": trace.attrs["world_size"],
        "loaded_hostnames": len(trace.attrs["hostnames"]),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
