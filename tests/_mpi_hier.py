"""The two-level ring against the flat one under mpiexec; rank 0 prints one RESULT line per case.

    mpiexec -n 4 python tests/_mpi_hier.py 0,0,0,1      # the node of every rank

Each rank's input is seeded by (rank, count, call), so the exact mean is known everywhere. A
case runs three calls (error feedback carries over) of the flat ring and of the two-level ring
on the same inputs, in one codec, and reports: the largest difference between the two and from
the exact mean (relative to the mean's largest magnitude), whether every rank holds the same
bits, and the sharded halves (reduce-scatter of the gradient, the weight gather of a master).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpihybrid.comm.allreduce import RingAllreduce  # noqa: E402
from mpihybrid.comm.codecs import get_codec  # noqa: E402
from mpihybrid.comm.hier_ring import NodeGroups, TwoLevelRing  # noqa: E402
from mpihybrid.comm.settings import RingSettings  # noqa: E402
from tests.helpers import abort_on_exception  # noqa: E402

sys.excepthook = abort_on_exception
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
nodes = [int(x) for x in sys.argv[1].split(",")]
SEGMENT = 64  # elements: several segments per chunk, and pieces that end inside segments


def data(r: int, count: int, call: int) -> np.ndarray:
    return np.random.default_rng([r, count, call]).standard_normal(count).astype(np.float32)


def same_everywhere(a: np.ndarray) -> bool:
    digest = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
    return len(set(comm.allgather(digest))) == 1


def run(ring, count: int) -> np.ndarray:
    for call in range(3):
        flat = data(rank, count, call)
        for request in ring.steps(flat, "mean"):
            request.Wait()
    return flat


groups = NodeGroups(comm, nodes)
for codec_name in ("fp32", "fp16", "bf16", "int8"):
    for count in (1000, 37, 2):
        codec = get_codec(codec_name, block=16)
        flat_ring = RingAllreduce(comm, count, RingSettings(codec, segment=SEGMENT))
        two = TwoLevelRing(groups, count, RingSettings(codec, segment=SEGMENT))
        a, b = run(flat_ring, count), run(two, count)
        exact = np.mean([data(r, count, 2).astype(np.float64) for r in range(size)], axis=0)
        scale = float(np.max(np.abs(exact)))
        # the sharded halves: a reduce-scatter's own chunk, then the weights' gather
        rs = TwoLevelRing(
            groups, count, RingSettings(codec, segment=SEGMENT), role="reduce_scatter"
        )
        grad = data(rank, count, 0)
        for request in rs.reduce_scatter_steps(grad, "mean"):
            request.Wait()
        lo, hi = rs.own_range
        exact0 = np.mean([data(r, count, 0).astype(np.float64) for r in range(size)], axis=0)
        rs_err = float(np.max(np.abs(grad[lo:hi] - exact0[lo:hi]), initial=0.0)) / scale
        gather = TwoLevelRing(
            groups,
            count,
            RingSettings(codec, error_feedback=False, segment=SEGMENT),
            role="all_gather",
            cuts=(5,),
        )
        weights = np.zeros(count, np.float32)
        master = data(99, count, 0)[lo:hi]  # what the owner of [lo, hi) holds
        for request in gather.gather_steps(weights, master):
            request.Wait()
        gathered_err = float(np.max(np.abs(weights - data(99, count, 0)))) / scale
        result = {
            "codec": codec_name, "count": count, "nodes": nodes,
            "flat_vs_two": float(np.max(np.abs(a - b))) / scale,
            "two_vs_exact": float(np.max(np.abs(b.astype(np.float64) - exact))) / scale,
            "flat_vs_exact": float(np.max(np.abs(a.astype(np.float64) - exact))) / scale,
            "identical": same_everywhere(b), "flat_identical": same_everywhere(a),
            "rs_err": max(comm.allgather(rs_err)),
            "gather_identical": same_everywhere(weights),
            "gather_err": gathered_err,
            "inter_bytes": comm.allreduce(two.bytes_sent["inter_node"]),
            "flat_bytes": comm.allreduce(flat_ring.bytes_sent["reduce_scatter"]
                                         + flat_ring.bytes_sent["all_gather"]),
        }  # fmt: skip
        for ring in (flat_ring, two, rs, gather):
            ring.close()
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
groups.free()
