"""grid.order = "auto": the order `predict --search` ranks first for the job's world and nodes.

    job, line = resolve_order(job, world)     # collective; the job with its order chosen

The job keeps its pp, dp, schedule, codecs and ring; both orders are predicted on the cluster
file `local` (the user's calibrated one first, comm: predict.cluster.find_cluster) with the
nodes MPI reports (comm.nodes: ranks per node from the launcher), and the faster one is run (a
tie: pipeline-inner). Rank 0 predicts and tells the others, so every rank runs the same order;
the line (printed at the start, kept in the trace as `order_choice`) says what was chosen and
why. An explicit order is kept as it is. Where MPI cannot say which ranks share a node: one
line, then pipeline-inner. A dp of 1 or a pp of 1 has one order: pipeline-inner, said so.
"""

from __future__ import annotations

import dataclasses

from mpi4py import MPI

from mpihybrid.comm.agree import rank0_decides
from mpihybrid.comm.nodes import node_map, ranks_per_node
from mpihybrid.config import Job
from mpihybrid.predict.cluster import Cluster, find_cluster, load_cluster
from mpihybrid.predict.model import order_predictions, with_order


def choose_order(job: Job, nodes: list[int] | None, cluster: Cluster) -> tuple[str, str]:
    """(the order to run, the line that says why) for a resolved job whose grid.order is auto,
    on ranks whose nodes are `nodes` (None: unknown)."""
    if nodes is None:
        return "pipeline-inner", (
            "grid.order = auto: MPI cannot say which ranks share a node: pipeline-inner"
        )
    if job.grid.pp == 1 or job.grid.dp == 1:
        return "pipeline-inner", "grid.order = auto: one order only (pp or dp is 1): pipeline-inner"
    counts = ranks_per_node(nodes)
    per_node = max(counts)
    on = dataclasses.replace(
        cluster, node=dataclasses.replace(cluster.node, ranks_per_node=per_node)
    )
    best, found = order_predictions(job, on)
    other = next(o for o in found if o != best)
    rate = {o: f["throughput"] for o, f in found.items()}
    return best, (
        f"grid.order = auto: {best} (predicted {rate[best]:,.0f} against {rate[other]:,.0f} "
        f"for {other}, on {len(counts)} node{'s' * (len(counts) > 1)} of "
        f"{'/'.join(map(str, counts))} ranks, cluster {cluster.name})"
    )


def resolve_order(job: Job, world: MPI.Comm, cluster: str = "local") -> tuple[Job, str]:
    """The job with grid.order chosen (collective over `world`) and the line saying how; an
    explicit order: the job as it is and ""."""
    if job.grid.order != "auto":
        return job, ""
    nodes = node_map(world)  # collective
    choice, error = rank0_decides(
        world, lambda: choose_order(job, nodes, load_cluster(find_cluster(cluster)))
    )
    if error is not None:  # a choice for all, and why
        choice = ("pipeline-inner", f"grid.order = auto: no prediction ({error}): pipeline-inner")
    order, line = choice
    return with_order(job, order), line
