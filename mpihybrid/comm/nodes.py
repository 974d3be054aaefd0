"""Which ranks share a node, as MPI reports it (collective over the world, the same on every rank).

    nodes = node_map(world)        # node index of every world rank, or None: MPI cannot say
    inter = crosses(nodes, a, b)   # whether world ranks a and b sit on different nodes

MPI_Comm_split_type(COMM_TYPE_SHARED) puts the ranks that can share memory, one node's, in one
communicator; nodes are numbered in the order of their lowest world rank. The launcher decides
it (Hydra: the ranks one proxy starts; under MPICH's MPIR_CVAR_NOLOCAL=1 every rank is a node
of its own). An MPI that cannot split by type gives None.

For tests and measurements only, MPIHYBRID_NODES names the node of every world rank instead
(`0,0,1` puts ranks 0 and 1 on node 0 and rank 2 on node 1; `unknown` plays an MPI that cannot
say): the two-level ring and the layout choice can then be exercised on one machine, where MPI
reports a single node. The ranks still talk through whatever MPI chose.
"""

from __future__ import annotations

import os

from mpi4py import MPI

NODES_ENV = "MPIHYBRID_NODES"


class NodeMapError(ValueError):
    """MPIHYBRID_NODES does not name a node for every rank (one line for the user)."""


def _from_env(text: str, size: int) -> list[int] | None:
    if text.strip() == "unknown":
        return None
    try:
        nodes = [int(x) for x in text.split(",")]
    except ValueError:
        nodes = []
    if len(nodes) != size or min(nodes) < 0:
        raise NodeMapError(
            f"{NODES_ENV} = {text!r}: give a node index >= 0 for each of the {size} ranks "
            "(comma-separated) or 'unknown'"
        )
    first: dict[int, int] = {}  # renumber in the order of each node's lowest rank
    return [first.setdefault(n, len(first)) for n in nodes]


def node_map(world: MPI.Comm) -> list[int] | None:
    """Node index of every world rank (collective); None when MPI cannot say."""
    override = os.environ.get(NODES_ENV)
    if override is not None:
        return _from_env(override, world.Get_size())
    try:
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    except (MPI.Exception, NotImplementedError):
        node = MPI.COMM_NULL
    lowest = -1 if node == MPI.COMM_NULL else node.allreduce(world.Get_rank(), op=MPI.MIN)
    if node != MPI.COMM_NULL:
        node.Free()
    lowest_of = world.allgather(lowest)
    if min(lowest_of) < 0:  # any rank without an answer: nobody has one
        return None
    first: dict[int, int] = {}
    return [first.setdefault(n, len(first)) for n in lowest_of]


def crosses(nodes: list[int] | None, a: int, b: int) -> bool:
    """Whether world ranks a and b are on different nodes (unknown: no)."""
    return nodes is not None and nodes[a] != nodes[b]


def ranks_per_node(nodes: list[int] | None) -> list[int]:
    """How many ranks each node holds, by node index ([] when unknown)."""
    if nodes is None:
        return []
    counts = [0] * (max(nodes) + 1)
    for n in nodes:
        counts[n] += 1
    return counts
