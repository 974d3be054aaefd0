"""What the wires cost in the model (predict/model.py composes it): where ranks sit on nodes,
a pipeline message (its link, its codec), the gradient ring's halves on one node or across, the
two-level ring of a dp group that spans nodes, and the sharded optimizer's ways.
"""

from __future__ import annotations

import math

from mpihybrid.comm.buckets import ring_kind
from mpihybrid.comm.codecs import get_codec
from mpihybrid.config import Job
from mpihybrid.nn.cost import FLOAT, ChunkWork
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.kinds import model_kind
from mpihybrid.pipeline.wire import encoded_peers
from mpihybrid.predict.cluster import Cluster, Device, Link
from mpihybrid.train import memory

# ---------------------------------------------------------------------------------------------
# placement: which ranks share a node


def job_placement(job: Job):
    """Which pp rank holds each chunk (the schedule's placement)."""
    return job.schedule.placement


def _node(rank: int, cluster: Cluster) -> int:
    return rank // cluster.node.ranks_per_node


def _nodes(job: Job, cluster: Cluster) -> list[int]:
    """The node of every world rank, as comm.nodes gives the run (the cluster's ranks a node)."""
    return [_node(r, cluster) for r in range(job.grid.pp * job.grid.dp)]


def _crossing(edges: list[tuple[int, int]], cluster: Cluster) -> tuple[bool, int]:
    """Whether any edge leaves its node, and the most crossing edges leaving one node."""
    out: dict[int, int] = {}
    for a, b in edges:
        if _node(a, cluster) != _node(b, cluster):
            out[_node(a, cluster)] = out.get(_node(a, cluster), 0) + 1
    return bool(out), max(out.values(), default=0)


def message_seconds(job: Job, work: list[ChunkWork], cluster: Cluster) -> float:
    """The slowest pipeline hop (activation or its gradient) between neighbouring chunks."""
    layout, placement, nodes = job.grid.layout, job_placement(job), _nodes(job, cluster)
    worst = 0.0
    for c in range(1, len(work)):
        sources = layout.replica_ranks(placement.rank_of(c - 1))
        edges = list(zip(sources, layout.replica_ranks(placement.rank_of(c)), strict=True))
        if all(a == b for a, b in edges):
            continue  # both chunks on one rank (interleaved, pp = 1)
        crosses, flows = _crossing(edges, cluster)
        link = cluster.links["network" if crosses else "node"]
        encoded = any(_encodes(job, a, b, nodes) for a, b in edges)
        nbytes, codec_s = p2p_bytes(job, work[c].input_bytes, encoded, cluster)
        worst = max(worst, link.after_idle(nbytes, flows) + codec_s)
    return worst


def tie_seconds(job: Job, cluster: Cluster) -> float:
    """model.tie_embeddings with the table and the head on two ranks (train/tie.py): at the
    step's end the head's gradient one way and the table back, V x C floats each; else 0."""
    if not model_kind(job.model.kind).stages_tie(job.model):  # vocab_parallel: no messages
        return 0.0
    layout, placement = job.grid.layout, job_placement(job)
    first, last = placement.rank_of(0), placement.rank_of(placement.num_stages - 1)
    if first == last:
        return 0.0
    edges = list(zip(layout.replica_ranks(first), layout.replica_ranks(last), strict=True))
    crosses, flows = _crossing(edges, cluster)
    link = cluster.links["network" if crosses else "node"]
    return 2 * link.seconds(FLOAT * task_dims(job.data)[1] * job.model.hidden, flows)


def p2p_encoded(job: Job, cluster: Cluster) -> bool:
    """Whether comm.p2p_codec would encode any pipeline link of the job (pipeline.wire's rule)."""
    g, placement, nodes = job.grid, job_placement(job), _nodes(job, cluster)
    for c in range(1, placement.num_stages):
        sources = g.layout.replica_ranks(placement.rank_of(c - 1))
        for a, b in zip(sources, g.layout.replica_ranks(placement.rank_of(c)), strict=True):
            if _encodes(job, a, b, nodes):
                return True
    return False


def _encodes(job: Job, a: int, b: int, nodes: list[int]) -> bool:
    """Whether the pipeline link between world ranks a and b carries comm.p2p_codec's bytes:
    the run's rule (pipeline.wire.encoded_peers), on the cluster's nodes."""
    scope = job.comm.p2p_codec_scope
    return job.comm.p2p_codec != "fp32" and bool(encoded_peers(scope, a, [b], nodes))


def p2p_bytes(job: Job, nbytes: int, encoded: bool, cluster: Cluster) -> tuple[int, float]:
    """A pipeline message of `nbytes` of float32 on the wire (pipeline.wire): (its bytes there,
    the seconds of its encode and decode) where its link is `encoded` in comm.p2p_codec."""
    c = job.comm
    if not encoded:
        return nbytes, 0.0
    count = nbytes // FLOAT
    rate = cluster.codecs[c.p2p_codec]
    wire = get_codec(c.p2p_codec, block=max(job.model.hidden, 1)).nbytes(count)
    return wire, nbytes / rate.encode + nbytes / rate.decode


def _ring_crosses(job: Job, pp_rank: int, cluster: Cluster) -> bool:
    """Whether the ring of pp position `pp_rank`'s replicas leaves a node."""
    return _crossing(_ring_edges(job.grid.layout.replica_ranks(pp_rank)), cluster)[0]


def _ring_edges(ranks: list[int]) -> list[tuple[int, int]]:
    """Each rank of a ring to the next."""
    return [(r, ranks[(i + 1) % len(ranks)]) for i, r in enumerate(ranks)]


def ring_seconds(job: Job, chunk: int, params: int, cluster: Cluster) -> tuple[float, float]:
    """One ring all-reduce of `params` gradients of a chunk's replicas: (seconds, of them the
    rank's own work): its reduce-scatter and its all-gather (ring_half). Sharded
    (train.shard_optimizer) the all-gather sends the weights in comm.param_codec, not the
    gradient's codec."""
    c = job.comm
    gather = (c.param_codec or "fp32") if job.train.shard_optimizer else c.codec
    levels = two_level(job, job_placement(job).rank_of(chunk), cluster)
    if levels is not None:
        local, nodes, spanning = levels
        return two_level_seconds(job, params, cluster, local, nodes, spanning=spanning)
    halves = [
        ring_half(job, chunk, params, cluster, c.codec, half="reduce_scatter"),
        ring_half(job, chunk, params, cluster, gather, half="all_gather"),
    ]
    return sum(h[0] for h in halves), sum(h[1] for h in halves)


def ring_half(
    job: Job, chunk: int, params: int, cluster: Cluster, codec_name: str, *, half: str
) -> tuple[float, float]:
    """One half of a chunk's ring ("reduce_scatter" or "all_gather") in `codec_name`: (seconds,
    of them the rank's own work): p - 1 hops of a chunk in messages of comm.segment_kb, the
    codec's encodes and decodes, the mean (with the reduce-scatter), the host copies on a GPU.
    A hop between ranks of one node on host memory is the rank's work too (MPI copies it through
    shared memory), but for a lossy ring there, whose segments the neighbour decodes where they
    were encoded: a message of 0 bytes."""
    g, c = job.grid, job.comm
    p = g.dp
    if p == 1 or params == 0:
        return 0.0, 0.0
    crosses = _ring_crosses(job, job_placement(job).rank_of(chunk), cluster)
    # every stage's ring runs at about the same time: count all of them on the node's way out
    all_edges = [e for r in range(g.pp) for e in _ring_edges(g.layout.replica_ranks(r))]
    _, flows = _crossing(all_edges, cluster)
    link: Link = cluster.links["network" if crosses else "node"]
    n = params / p
    codec = get_codec(codec_name, c.block)
    rate = cluster.codecs[codec_name]
    messages = math.ceil(n / (c.segment_kb * 256))
    d = cluster.device
    shared = shared_wire(codec.lossy, crosses, d)
    if shared:  # only "it is written" travels (comm.shm)
        hop = messages * link.alpha_s
    else:
        hop = (messages - 1) * link.alpha_s + link.seconds(codec.nbytes(math.ceil(n)), flows)
    wire = (p - 1) * hop
    sharded = job.train.shard_optimizer
    if half == "reduce_scatter":
        # lossy: an encode and a decode-add per hop; fp32: a received chunk is added
        work = (p - 1) * n * FLOAT * ((1 / rate.encode if codec.lossy else 0) + 1 / rate.decode)
        # the mean: flat /= p (sharded: the owned chunk alone)
        work += 2 * FLOAT * (n if sharded else params) / d.mem_bandwidth
    elif codec.lossy:  # the owner's one encode, p - 1 decodes (a weight gather: the owner too)
        work = n * FLOAT / rate.encode + (p if sharded else p - 1) * n * FLOAT / rate.decode
    else:  # fp32: a received chunk lands in place
        work = 0.0
    if d.host_copy_bandwidth:
        work += params * FLOAT / d.host_copy_bandwidth
    copies = not (crosses or d.host_copy_bandwidth or shared)
    return wire + work, work + (wire if copies else 0.0)


def _group_nodes(job: Job, pp_rank: int, cluster: Cluster) -> dict[int, int]:
    """How many of pp position `pp_rank`'s replicas each node holds."""
    per_node: dict[int, int] = {}
    for rank in job.grid.layout.replica_ranks(pp_rank):
        node = _node(rank, cluster)
        per_node[node] = per_node.get(node, 0) + 1
    return per_node


def two_level(job: Job, pp_rank: int, cluster: Cluster) -> tuple[int, int, int] | None:
    """(ranks of the dp group on its fullest node, nodes it spans, pp positions whose groups
    span nodes) when pp position `pp_rank`'s ring is the two-level one (the run's rule:
    comm.buckets.ring_kind), else None."""
    nodes = _nodes(job, cluster)
    group = [nodes[r] for r in job.grid.layout.replica_ranks(pp_rank)]
    if ring_kind(job.comm.ring, group)[0] != "hierarchical":
        return None
    per_node = _group_nodes(job, pp_rank, cluster)
    spanning = sum(_ring_crosses(job, r, cluster) for r in range(job.grid.pp))
    return max(per_node.values()), len(per_node), spanning


def two_level_seconds(
    job: Job, params: int, cluster: Cluster, local: int, nodes: int, *, spanning: int
) -> tuple[float, float]:
    """comm.hier_ring's ring of `params` gradients: (seconds, of them the rank's own work).
    Inside the node a reduce-scatter of the codec over `local` ranks (a lossy one on shared
    memory: only "written" travels), across the nodes an all-reduce of the rank's chunk of
    params / local among one owner per node (every owner of every spanning stage's group
    leaves its node at once: local x spanning flows), inside the node an fp32 all-gather
    (sharded: the weights in comm.param_codec); the mean."""
    c, d = job.comm, cluster.device
    sharded = job.train.shard_optimizer
    node, network = cluster.links["node"], cluster.links["network"]
    codec, rate = get_codec(c.codec, c.block), cluster.codecs[c.codec]
    gather_name = (c.param_codec or "fp32") if sharded else "fp32"
    gather, grate = get_codec(gather_name, c.block), cluster.codecs[gather_name]
    seg = c.segment_kb * 256
    chunk = params / local  # what one rank owns after the node's reduce-scatter
    piece = chunk / nodes  # what it owns in the ring across
    wire = work = copies = 0.0
    if local > 1:
        msgs = math.ceil(chunk / seg)
        shared = shared_wire(codec.lossy, False, d)
        hop = msgs * node.alpha_s if shared else node.seconds(codec.nbytes(math.ceil(chunk)), 1)
        wire += (local - 1) * hop
        copies += 0.0 if shared else (local - 1) * hop
        work += (
            (local - 1)
            * chunk
            * FLOAT
            * ((1 / rate.encode if codec.lossy else 0) + 1 / rate.decode)
        )
        ghop = node.seconds(gather.nbytes(math.ceil(chunk)), 1)  # all-gather, messages
        wire += (local - 1) * ghop
        copies += (local - 1) * ghop
        if gather.lossy:
            work += chunk * FLOAT / grate.encode + local * chunk * FLOAT / grate.decode
    flows = local * max(spanning, 1)
    msgs = math.ceil(piece / seg)
    hop = (msgs - 1) * network.alpha_s + network.seconds(codec.nbytes(math.ceil(piece)), flows)
    wire += 2 * (nodes - 1) * hop
    if codec.lossy:  # across: an encode and a decode per hop, the owner's encode, its decodes
        work += (nodes - 1) * piece * FLOAT * (1 / rate.encode + 1 / rate.decode)
        work += piece * FLOAT / rate.encode + nodes * piece * FLOAT / rate.decode
    else:
        work += (nodes - 1) * piece * FLOAT / rate.decode
    work += 2 * FLOAT * (chunk if sharded else params) / d.mem_bandwidth  # the mean
    if d.host_copy_bandwidth:
        work += params * FLOAT / d.host_copy_bandwidth
    return wire + work, work + copies


def shard_ways(job: Job, pp_rank: int, cluster: Cluster) -> int:
    """Over how many ranks train.shard_optimizer splits a bucket's update on the rank that
    updates most: train.memory.shard_ways (the run's rule) at its fewest over the group."""
    nodes = _nodes(job, cluster)
    group = job.grid.layout.replica_ranks(pp_rank)
    return min(memory.shard_ways(job, pp_rank, r, nodes) for r in group)


def shared_wire(lossy: bool, crosses: bool, device: Device) -> bool:
    """Whether a ring's encoded segments stay in an MPI-3 shared window that the neighbours
    decode from (comm.allreduce, transport "auto"): a lossy ring on one node, on the CPU."""
    return lossy and not crosses and not device.host_copy_bandwidth
