"""The two-level ring: a stage's replicas that span nodes reduce inside each node first.

    groups = NodeGroups(dp_comm, nodes)          # nodes: the node of every dp rank (collective)
    ring = TwoLevelRing(groups, count, settings, residual=r)  # like comm.allreduce.RingAllreduce
    for request in ring.steps(flat): request.Wait()

A flat ring over ranks on two nodes sends every chunk across the link at each hop that crosses
it; NCCL and Horovod instead reduce inside a node, then across. Here, for a vector of `count`:

1. reduce-scatter inside each node (comm.allreduce's ring over the node's ranks, in the codec,
   on shared memory where the flat ring uses it): node n's local rank owns chunk (r + 1) % L_n
   of the vector cut into L_n chunks, holding the node's exact fp32 sum there;
2. across nodes: the vector is cut at every node's chunk bounds into pieces; each piece has one
   owner per node, and those owners all-reduce it (a RingAllreduce of the codec over a
   communicator of the owners, one per owner set). A node of fewer ranks has owners that take
   part in several pieces' rings, one after the other; a rank owns one contiguous chunk either way;
3. all-gather inside each node, in fp32: every rank of every node ends with the bits the piece
   rings left on their owners, which are the same on every node, so replicas stay bit-identical
   whatever the codec and whatever the node sizes (a lossy all-gather here would quantise
   again, along each node's own segments).

Across the link each rank sends 2 (N - 1) / N of its chunk (N nodes), a node L times that: for
two nodes of L ranks a node, count bytes each way, where a flat ring of 2L ranks sends
(2L - 1) / L of count across each link direction on which its ring crosses (two crossings:
about twice as many bytes on the link).

Error feedback: each rank encodes each element once per call, as in the flat ring: the
reduce-scatter encodes the partial sums it passes on (their error kept where they lie) and adds
the residual of its own chunk to the exact sum there (then zero), the piece rings encode the
owned chunk and keep their error in the same residual, which joins the next call's node sum.

The sharded optimizer (role "reduce_scatter" then a weight ring of role "all_gather"): steps 1
and 2 leave each rank with its node chunk's mean, so it updates that chunk (the optimizer state
is sharded over a node's ranks: the owners of one chunk on different nodes make the same update
from the same bits); the weights are then gathered inside the node only, in comm.param_codec,
with segments on one grid for every node (comm.ring_layout origin 0, every node's chunk bounds
as cuts), so a lossy codec's blocks, and its bytes, are the same on every node; a node of one
rank encodes and decodes its own chunk the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.allreduce import DEFAULTS, RingAllreduce
from mpihybrid.comm.codecs import get_codec
from mpihybrid.comm.ring_layout import chunk_bounds, segment_layout
from mpihybrid.comm.settings import RingSettings


class NodeGroups:
    """A dp group's ranks by node, its communicator inside this rank's node, and the
    communicators of the piece owners (made on demand: collective over dp_comm, in one order)."""

    def __init__(self, dp_comm: MPI.Comm, nodes: list[int]) -> None:
        if len(nodes) != dp_comm.Get_size():
            raise ValueError(f"nodes names {len(nodes)} ranks, the dp group has {dp_comm.size}")
        self.dp_comm, self.dp_rank = dp_comm, dp_comm.Get_rank()
        order = sorted(set(nodes), key=nodes.index)  # by each node's lowest dp rank
        self.members = [[r for r in range(len(nodes)) if nodes[r] == n] for n in order]
        self.node = order.index(nodes[self.dp_rank])
        self.intra = dp_comm.Split(self.node, self.dp_rank)
        self._inter: dict[tuple[int, ...], MPI.Comm] = {}

    @property
    def num_nodes(self) -> int:
        return len(self.members)

    def pieces(self, count: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(lo, hi, owners): the vector cut at every node's chunk bounds, and each piece's owner
        on every node (dp ranks, in node order)."""
        bounds = [[int(b) for b in chunk_bounds(count, len(m))] for m in self.members]
        cuts = sorted({b for node in bounds for b in node})
        out = []
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            owners = []
            for members, b in zip(self.members, bounds, strict=True):
                c = int(np.searchsorted(b, lo, side="right")) - 1  # the node chunk holding lo
                owners.append(members[(c - 1) % len(members)])  # rank r owns chunk (r + 1) % L
            out.append((lo, hi, tuple(owners)))
        return out

    def cuts(self, count: int) -> tuple[int, ...]:
        """Every node's chunk bounds."""
        return tuple(sorted({int(b) for m in self.members for b in chunk_bounds(count, len(m))}))

    def inter(self, owners: tuple[int, ...]) -> MPI.Comm | None:
        """The owners' communicator, in node order (collective over dp_comm the first time)."""
        if owners not in self._inter:
            mine = self.dp_rank in owners
            color = 0 if mine else MPI.UNDEFINED
            key = owners.index(self.dp_rank) if mine else 0
            self._inter[owners] = self.dp_comm.Split(color, key)
        comm = self._inter[owners]
        return None if comm == MPI.COMM_NULL else comm

    def free(self) -> None:
        for comm in self._inter.values():
            if comm != MPI.COMM_NULL:
                comm.Free()
        self._inter = {}
        self.intra.Free()


class TwoLevelRing:
    """RingAllreduce's interface (steps, reduce_scatter_steps, gather_steps, own_range,
    bytes_sent, last_sent, compress, close) over a dp group that spans nodes."""

    def __init__(
        self,
        groups: NodeGroups,
        count: int,
        settings: RingSettings = DEFAULTS,
        *,
        residual: np.ndarray | None = None,
        role: str = "allreduce",
        cuts: tuple[int, ...] = (),
    ) -> None:
        codec, backend = settings.codec, settings.backend
        self.groups, self.count, self.codec, self.role = groups, count, codec, role
        self.dp_size = groups.dp_comm.Get_size()
        self.compress = codec.lossy and self.dp_size > 1 and count > 0
        self.bytes_sent: dict[str, int] = {"reduce_scatter": 0, "all_gather": 0, "inter_node": 0}
        self.last_sent = 0
        self.residual = None
        if codec.lossy and settings.error_feedback and role != "all_gather":
            self.residual = backend.zeros(count, np.float32) if residual is None else residual
        intra = groups.intra
        if role == "all_gather":  # the weight gather: inside the node, one grid for all nodes
            grid = tuple(sorted({*cuts, *groups.cuts(count)}))
            self.gather = RingAllreduce(
                intra, count, settings, role="all_gather", cuts=grid, origin=0
            )
            self.own_range = self.gather.own_range
            self._alone = None
            if intra.Get_size() == 1 and self.compress:  # quantised like the other nodes'
                self._alone, _ = segment_layout(
                    count, 1, settings.segment, grid, codec.nbytes, origin=0
                )
                self._scratch = backend.empty(max(s[3] for s in self._alone[0]), np.uint8)
            self.inner, self.rings = None, []
            return
        self.inner = RingAllreduce(
            intra, count, settings, residual=self.residual, role="reduce_scatter"
        )
        self.own_range = self.inner.own_range
        self.rings = []  # (lo, hi, ring) of the pieces this rank owns, in vector order
        for lo, hi, owners in groups.pieces(count):
            comm = groups.inter(owners)
            if comm is not None and hi > lo:
                part = None if self.residual is None else self.residual[lo:hi]
                self.rings.append((lo, hi, RingAllreduce(comm, hi - lo, settings, residual=part)))
        # inside the node, fp32: the piece rings' bits to every rank (module docstring)
        self.gather = None
        if role == "allreduce":
            fp32 = replace(settings, codec=get_codec("fp32"), error_feedback=False)
            self.gather = RingAllreduce(intra, count, fp32, role="all_gather")

    def _sum_across(self, flat: np.ndarray) -> Iterator[MPI.Request]:
        """Steps 1 and 2: afterwards flat[own_range] holds the sum over the whole dp group."""
        yield from self.inner.reduce_scatter_steps(flat, "sum")
        self._count(self.inner, "reduce_scatter")
        for lo, hi, ring in self.rings:
            yield from ring.steps(flat[lo:hi], "sum")
            self._count(ring, "inter_node")

    def _count(self, ring: RingAllreduce, kind: str) -> None:
        self.bytes_sent[kind] += ring.last_sent
        self.last_sent += ring.last_sent

    def steps(self, flat: np.ndarray, op: str = "mean") -> Iterator[MPI.Request]:
        self.last_sent = 0
        if self.role != "allreduce":
            raise ValueError(f"a ring of role {self.role!r} cannot run this (allreduce)")
        yield from self._sum_across(flat)
        yield from self.gather.gather_steps(flat)
        self._count(self.gather, "all_gather")
        if op == "mean":
            flat /= self.dp_size

    def reduce_scatter_steps(self, flat: np.ndarray, op: str = "mean") -> Iterator[MPI.Request]:
        self.last_sent = 0
        if self.role == "all_gather":
            raise ValueError("a ring of role 'all_gather' cannot run this (reduce_scatter)")
        yield from self._sum_across(flat)
        if op == "mean":
            lo, hi = self.own_range
            flat[lo:hi] /= self.dp_size

    def gather_steps(
        self, flat: np.ndarray, master: np.ndarray | None = None
    ) -> Iterator[MPI.Request]:
        self.last_sent = 0
        if self.role != "all_gather":
            raise ValueError(f"a ring of role {self.role!r} cannot run this (all_gather)")
        if self._alone is not None:  # this node's one rank: the other nodes' bits, by itself
            lo = self.own_range[0]
            source = flat if master is None else master
            for slo, shi, _, nbytes in self._alone[0]:
                wire = self._scratch[:nbytes]
                self.codec.encode(source[slo - lo : shi - lo], wire)
                self.codec.decode(wire, shi - slo, flat[slo:shi])
            return
        yield from self.gather.gather_steps(flat, master)
        self._count(self.gather, "all_gather")

    @property
    def buffer_bytes(self) -> int:
        rings = [r for _, _, r in self.rings] + [r for r in (self.inner, self.gather) if r]
        return sum(r.buffer_bytes for r in rings)

    def close(self) -> None:
        """Free the rings' shared windows (collective over each ring's communicator)."""
        for ring in (self.inner, *(r for _, _, r in self.rings), self.gather):
            if ring is not None:
                ring.close()
