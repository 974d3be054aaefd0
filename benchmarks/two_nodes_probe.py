"""Is it two nodes? What MPI says shares a node, and what a message costs inside and between.

    sudo benchmarks/two_nodes.sh run A:2,B:2 python benchmarks/two_nodes_probe.py [--mib 8]

Rank 0 prints one line per check and a last `RESULT {json}` line: the nodes MPI reports
(MPI_Comm_split_type SHARED, as world ranks), each rank's hostname, and for rank 0 with a rank
of its own node and with one of the other node: the time of an N MiB exchange (both send N MiB
to each other at once, best of --repeats), its rate per direction, and how many bytes the
node's link end sent meanwhile (FI_TCP_IFACE's counter; -1 without one). Inside a node the
bytes stay off the link; between the nodes they cross it at the shaped rate.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def link_bytes() -> int:
    name = os.environ.get("FI_TCP_IFACE", "")
    try:
        with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1


def exchange(peer: int | None, nbytes: int, repeats: int) -> dict:
    """Rank 0 and `peer` swap nbytes; every rank returns what rank 0 measured."""
    rank, found = WORLD.Get_rank(), {}
    if peer is not None and rank in (0, peer):
        other = peer if rank == 0 else 0
        out, into = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        before, best = link_bytes(), float("inf")
        for _ in range(repeats):
            WORLD.Sendrecv(out[:1], other, recvbuf=into[:1], source=other)  # both ready
            t0 = time.perf_counter()
            WORLD.Sendrecv(out, other, recvbuf=into, source=other)
            best = min(best, time.perf_counter() - t0)
        sent = link_bytes() - before if before >= 0 else -1
        found = {"peer": peer, "seconds": best, "gbit_s": 8 * nbytes / best / 1e9,
                 "link_bytes": sent}  # fmt: skip
    WORLD.Barrier()
    return WORLD.bcast(found, root=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    nbytes = int(args.mib * 2**20)
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.Get_rank())
    members = node.allgather(WORLD.Get_rank())
    everyone = WORLD.allgather((socket.gethostname(), members))
    nodes = sorted({tuple(m) for _, m in everyone})
    mine = everyone[0][1]
    same = next((r for r in mine if r != 0), None)
    other = next((r for r in range(WORLD.Get_size()) if r not in mine), None)
    result = {
        "nodes": [list(n) for n in nodes],
        "hosts": [h for h, _ in everyone],
        "mib": args.mib,
        "same_node": exchange(same, nbytes, args.repeats),
        "cross_node": exchange(other, nbytes, args.repeats),
    }
    if WORLD.Get_rank() == 0:
        print(f"nodes (world ranks): {result['nodes']}; hosts: {result['hosts']}")
        for kind in ("same_node", "cross_node"):
            r = result[kind]
            if r:
                print(f"{kind}: rank 0 <-> {r['peer']}: {args.mib:g} MiB each way in "
                      f"{r['seconds'] * 1e3:.1f} ms = {r['gbit_s']:.2f} Gbit/s per direction; "
                      f"link bytes sent by rank 0's node: {r['link_bytes']}")  # fmt: skip
        print("RESULT " + json.dumps(result))
    node.Free()


if __name__ == "__main__":
    main()
