"""Train one job in several variants under one mpiexec; rank 0 prints a RESULT line per variant.

    MPIHYBRID_NODES=0,1,0,1 mpiexec -n 4 python tests/_mpi_nodes.py --set grid.pp=2 \
        --variant fp32 --variant bf16:comm.p2p_codec=bf16 ...

A variant is NAME or NAME:KEY=VALUE[;KEY=VALUE...] on top of the --set overrides. Each line has
the losses, the replicas' largest difference, the bytes sent by kind and a SHA-256 of replica 0's
final parameters (bit-for-bit comparisons), and the parameters' largest difference from the
first variant's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpihybrid.config import load_job  # noqa: E402
from mpihybrid.train.loop import train  # noqa: E402
from tests.helpers import abort_on_exception  # noqa: E402

sys.excepthook = abort_on_exception

parser = argparse.ArgumentParser()
parser.add_argument("--set", dest="overrides", action="append", default=[])
parser.add_argument("--variant", dest="variants", action="append", default=[])
args = parser.parse_args()

world = MPI.COMM_WORLD
first = None
for variant in args.variants:
    name, _, extra = variant.partition(":")
    overrides = [*args.overrides, *(x for x in extra.split(";") if x)]
    job = load_job(None, overrides, world.Get_size())
    summary = train(job, world, quiet=True, collect_params=True)
    if world.rank != 0:
        continue
    params = np.concatenate(summary.params)
    first = params if first is None else first
    print("RESULT " + json.dumps({
        "name": name,
        "losses": summary.losses,
        "replica_max_diff": max(summary.replica_max_diff.values()),
        "bytes_sent": summary.bytes_sent,
        "sha": hashlib.sha256(params.tobytes()).hexdigest(),
        "max_diff_first": float(np.max(np.abs(params - first))),
        "extra": {k: v for k, v in summary.extra.items() if isinstance(v, (str, int, float))},
    }), flush=True)  # fmt: skip
