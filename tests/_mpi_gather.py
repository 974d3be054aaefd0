"""The distributed optimizer's two rings, checked in one small launch; rank 0 prints RESULT lines.

mpiexec -n 3 python tests/_mpi_gather.py

cuts     an int8 weight gather of a vector of three tensors, a LayerNorm-like gain of ones, a
         bias of 1e-3's and a weight of 0.02's, in blocks larger than each: the error of each
         tensor relative to half a step of its own absmax scale (<= 1 with the tensor
         boundaries as cuts; without them the small tensors share the gain's scale)
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpihybrid.comm.allreduce import RingAllreduce  # noqa: E402
from mpihybrid.comm.codecs import get_codec  # noqa: E402
from tests.helpers import abort_on_exception  # noqa: E402

sys.excepthook = abort_on_exception
comm = MPI.COMM_WORLD


def emit(**fields) -> None:
    if comm.rank == 0:
        print("RESULT", json.dumps(fields), flush=True)


def gather_errors(cuts: tuple[int, ...], transport: str) -> list[float]:
    """Each tensor's max error after an int8 gather, in units of its own absmax / 254."""
    rng = np.random.default_rng(0)
    sizes, scales = (70, 45, 200), (None, 1e-3, 0.02)
    tensors = [np.ones(sizes[0], np.float32)] + [
        (s * rng.standard_normal(n)).astype(np.float32)
        for n, s in zip(sizes[1:], scales[1:], strict=True)
    ]
    truth = np.concatenate(tensors)
    ring = RingAllreduce(comm, truth.size, get_codec("int8", 256), segment=128,
                         transport=transport, gather_only=True, cuts=cuts)  # fmt: skip
    flat = np.zeros_like(truth)
    lo, hi = ring.own_range
    for request in ring.gather_steps(flat, truth[lo:hi].copy()):
        request.Wait()
    ring.close()
    same = comm.allreduce(int(np.array_equal(flat, comm.bcast(flat, root=0))), op=MPI.MIN)
    assert same, "replicas differ"
    edges = np.cumsum((0,) + sizes)
    return [
        float(np.abs(flat[a:b] - truth[a:b]).max() / (np.abs(truth[a:b]).max() / 254))
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]


for transport in ("auto", "mpi"):
    emit(case="cuts", transport=transport, with_cuts=gather_errors((70, 115), transport),
         without=gather_errors((), transport))  # fmt: skip
