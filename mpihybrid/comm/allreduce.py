"""Hand-written ring all-reduce over dp_comm: reduce-scatter then all-gather, pipelined in segments.

    ring = RingAllreduce(grid.dp_comm, flat_grad.size, RingSettings(get_codec("int8")))
    sent = ring(flat_grad, op="mean")       # in place, blocking; the bytes this rank sent
    steps = ring.steps(flat_grad)           # the same as a generator of MPI requests to wait on

p = dp_size ranks, the vector cut into p chunks (np.array_split bounds). Ring neighbours:
rank r sends to (r + 1) % p and receives from (r - 1) % p.
    reduce-scatter, step s = 0..p-2: send chunk (r - s) % p, receive chunk (r - s - 1) % p and
        add it to our own; afterwards rank r holds the full sum of chunk (r + 1) % p.
    all-gather, step s = 0..p-2: send chunk (r + 1 - s) % p, receive chunk (r - s) % p.

Pipelined: every chunk is cut into segments (comm.ring_layout), each a message of its own, and
all of them are non-blocking (Isend/Irecv). A segment moves on as soon as it is ready: segment k
of step s is added (reduce-scatter) or forwarded (all-gather) the moment it arrives, while k + 1
is still on the wire and k - 1 is being encoded for the next step; a segment of the rank's own
chunk leaves for the all-gather as soon as its last reduce-scatter hop is added. Receives are
posted before their data can arrive (fp32's all-gather once the reduce-scatter's sends are done:
it lands where they read from). All buffers are allocated once, in __init__.

Shared memory (transport="auto", a lossy ring whose ranks are all on one node, on the CPU): the
wire is an MPI-3 shared window (comm.shm). A segment is encoded into this rank's slot and a
zero-byte message tells the neighbour, whose kernel decodes it where it lies; in the all-gather
every rank decodes the owner's slot. No byte is copied between ranks (a message's copy is work
for a core that has none to spare), and an Ibarrier at the end keeps every slot until all have
read it. Across nodes, or with transport="mpi", the segments travel as messages.

Where the vector lives: on a GPU (`backend`, comm.device.Backend) the codecs run on the device
and the wire buffers live there too; without CUDA-aware MPI each message goes through the
backend's persistent host staging, so only encoded bytes cross PCIe. On the CPU nothing is copied.

Compressed (lossy codec): every segment that goes on the wire is encoded once, by the rank that
computed it. In the all-gather the owner encodes its reduced chunk once and those exact bytes go
round the ring unchanged; every rank, the owner included, decodes the same bytes, so all replicas
end bit-identical (the owner's last add, encode and decode are one pass: Codec.reduce_encode).
Error feedback: `residual` (this rank's encoding error per element) is added to the input before
the ring; each element is encoded by this rank exactly once per call and its new
error replaces the residual there, so errors telescope into the next call instead of piling up.
With p = 1 nothing travels and nothing is quantised: the call leaves the vector as it is.

The distributed optimizer (ZeRO-1) splits the two halves around its update:

    for r in ring.reduce_scatter_steps(flat_grad): r.Wait()  # own_range: the mean there, fp32
    optimizer.update(...own_range...)                         # only this rank's chunk
    for r in param_ring.gather_steps(flat_param, master): r.Wait()  # the updated weights

A ring of one half (`role`) allocates that half's buffers alone. A reduce-scatter leaves the
owner's chunk exact (its share of the residual joins it and is spent). The weight all-gather
(comm.param_codec, no residual, segments cut at tensor boundaries) encodes the owner's fp32
`master` once and every replica, the owner too, decodes those bytes: replicas stay identical,
and the next step encodes from the master again, so the error never accumulates.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.device import CPU
from mpihybrid.comm.ring_layout import aligned, chunk_bounds, segment_layout
from mpihybrid.comm.settings import RingSettings
from mpihybrid.comm.shm import SharedWire, node_local

# the ring's message tags on dp_comm (its own communicator: no clash with pipeline tags)
TAG_REDUCE_SCATTER = 101
TAG_ALL_GATHER = 102
DEFAULTS = RingSettings()  # fp32, error feedback, DEFAULT_SEGMENT, transport auto, the CPU
ROLES = ("allreduce", "reduce_scatter", "all_gather")  # both halves, or one (module docstring)
_SERIAL = itertools.count()  # names each ring's staging buffers (an id() is reused once freed)


class RingAllreduce:
    """In-place all-reduce of one float32 vector of fixed length over `dp_comm`.

    residual: where the error-feedback residual lives (a float32 vector of `count`, e.g. a view
    of a bigger one); None allocates one when the codec is lossy and error_feedback is on.
    settings.transport: "auto" reads a lossy ring's segments from the neighbour's shared memory when
    every rank of dp_comm is on one node and the vector is on the CPU; "mpi" always sends them
    as messages. Construction is collective over dp_comm; close() frees what it shares.
    """

    def __init__(
        self,
        dp_comm: MPI.Comm,
        count: int,
        settings: RingSettings = DEFAULTS,
        *,
        residual: np.ndarray | None = None,
        role: str = "allreduce",
        cuts: tuple[int, ...] = (),
        origin: int | None = None,
    ) -> None:
        """settings: the codec, error feedback, segment, transport and backend (comm.settings).
        role: "reduce_scatter" or "all_gather" allocates what that half needs alone (the
        distributed optimizer's gradient ring, its weight ring: steps() is refused). cuts:
        where a lossy ring's segments also end (comm.ring_layout: the weight gather's tensors);
        origin: a lossy ring's segments on a grid from there (comm.ring_layout)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        codec, backend = settings.codec, settings.backend
        self.dp_comm, self.backend = dp_comm, backend
        self._name = ("ring", next(_SERIAL))
        self.count = count
        self.codec = codec
        self.dp_rank = dp_comm.Get_rank()
        self.dp_size = dp_comm.Get_size()
        self.next_rank = (self.dp_rank + 1) % self.dp_size
        self.prev_rank = (self.dp_rank - 1) % self.dp_size
        self.bytes_sent: dict[str, int] = {"reduce_scatter": 0, "all_gather": 0}
        self.compress = codec.lossy and self.dp_size > 1 and count > 0
        self.role = role
        self.residual: np.ndarray | None = None
        if codec.lossy and settings.error_feedback and role != "all_gather":
            self.residual = backend.zeros(count, np.float32) if residual is None else residual
            if self.residual.shape != (count,) or self.residual.dtype != np.float32:
                raise ValueError(f"residual must be float32 of length {count}")
        self._layout(settings.segment, settings.transport, cuts, origin)

    def _layout(
        self, segment: int, transport: str, cuts: tuple[int, ...], origin: int | None
    ) -> None:
        """Chunks, their segments, and each segment's slot in the wire buffers."""
        p, codec = self.dp_size, self.codec
        bounds = [int(b) for b in chunk_bounds(self.count, p)]
        # fp32 copies bits: no codec block to keep apart, no cut
        self.segments, offset = segment_layout(
            self.count,
            p,
            segment,
            cuts if self.compress else (),
            codec.nbytes if self.compress else lambda n: 4 * n,
            origin=origin if self.compress else None,
        )
        self.chunk_nbytes = [sum(s[3] for s in segs) for segs in self.segments]
        own = (self.dp_rank + 1) % p  # the chunk this rank's reduce-scatter completes
        self.own_range = (bounds[own], bounds[own + 1])
        self.shared: SharedWire | None = None
        local = transport == "auto" and self.backend is CPU
        if self.compress and local and node_local(self.dp_comm):  # collective: all or none
            # a zero-byte message per segment says "ready"; the bytes stay where they were
            # encoded, and every reader decodes them there
            self.shared = SharedWire(self.dp_comm, offset)
            self.wire = self.shared.own
            self.gather_wire = self.recv_buf = self.backend.empty(0, np.uint8)
            self._token = np.empty(0, np.uint8)
            return
        # compressed: the all-gather lands in a wire of its own, so its receives can be posted
        # before the reduce-scatter and the neighbour's early segments move whenever either
        # rank is inside MPI (fp32 lands in the vector, after the reduce-scatter's sends)
        gathers = self.compress and self.role != "reduce_scatter"
        self.gather_wire = self.backend.empty(offset if gathers else 0, np.uint8)
        # compressed: the wire holds every chunk's encoded segments (sent, or received and
        # forwarded); fp32 sends from the vector and receives the reduce-scatter into recv_buf.
        # A weight gather encodes its own chunk into the gather wire, where nothing lands
        alone = self.role == "all_gather"
        self.wire = (
            self.gather_wire if alone else self.backend.empty(offset * self.compress, np.uint8)
        )
        # the reduce-scatter receives step s into half s % 2 (two steps may be in flight)
        half = max((self._span(c) for c in range(p)), default=0) if not alone else 0
        self.recv_buf = self.backend.empty(min(2, p - 1) * half, np.uint8)
        self._recv_half = half

    @property
    def buffer_bytes(self) -> int:
        """Bytes of this rank's wire buffers (shared: its window)."""
        return sum({id(a): a.nbytes for a in (self.wire, self.gather_wire, self.recv_buf)}.values())

    def _span(self, c: int) -> int:
        """Bytes chunk c's segments occupy in a wire buffer, alignment included."""
        segs = self.segments[c]
        return segs[-1][2] + aligned(segs[-1][3]) - segs[0][2] if segs else 0

    def _slot(self, c: int, k: int) -> np.ndarray:
        """Segment k of chunk c in the wire buffer."""
        _, _, offset, nbytes = self.segments[c][k]
        return self.wire[offset : offset + nbytes]

    def _recv_slot(self, step: int, c: int, k: int) -> np.ndarray:
        _, _, offset, nbytes = self.segments[c][k]
        if self.shared is not None:  # the neighbour's own slot
            return self.shared.of(self.prev_rank)[offset : offset + nbytes]
        start = (step % 2) * self._recv_half + offset - self.segments[c][0][2]
        return self.recv_buf[start : start + nbytes]

    def _encode(self, flat: np.ndarray, c: int, k: int, first_use: bool = False) -> np.ndarray:
        """The bytes to send for segment k of chunk c; lossy: encoded once, error kept.
        first_use: the segment has not met its residual yet (see _residual_of)."""
        lo, hi, _, _ = self.segments[c][k]
        if not self.compress:
            return flat[lo:hi].view(np.uint8)
        slot = self._slot(c, k)
        residual = self._residual_of(c, k)
        feedback = first_use and residual is not None
        self.codec.encode(flat[lo:hi], slot, residual, add_residual=feedback)
        return slot

    def _residual_of(self, c: int, k: int) -> np.ndarray | None:
        """Error feedback: segment k of chunk c's residual. Last call's error joins this rank's
        contribution at the segment's first use, which is either reduce-scatter step 0's send
        (encode x + residual) or its one receive in the reduce-scatter ((x + residual) +
        received): the codec does the addition in the same pass."""
        if self.residual is None:
            return None
        lo, hi, _, _ = self.segments[c][k]
        return self.residual[lo:hi]

    def _check(self, flat: np.ndarray, op: str, *roles: str) -> None:
        if self.role not in roles:
            raise ValueError(f"a ring of role {self.role!r} cannot run this ({', '.join(roles)})")
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        if flat.dtype != np.float32 or flat.shape != (self.count,) or not flat.flags.c_contiguous:
            raise ValueError(
                f"expected a contiguous float32 vector of length {self.count}, "
                f"got {flat.dtype} {flat.shape}"
            )

    def __call__(self, flat: np.ndarray, op: str = "mean") -> int:
        """All-reduce `flat` (float32, length count) in place; returns the bytes this rank sent."""
        for request in self.steps(flat, op):
            request.Wait()
        return self.last_sent

    def steps(self, flat: np.ndarray, op: str = "mean") -> Iterator[MPI.Request]:
        """The all-reduce as a generator: each item is a request that must complete before the
        generator is resumed (a driver Waits on it, or Tests it between other work)."""
        self._check(flat, op, "allreduce")
        self.last_sent = 0
        if self.dp_size == 1 or self.count == 0:
            return
        gather_recvs = self._post_gather(flat) if self.compress else None
        gather_sends: list[MPI.Request] = []  # the owner's all-gather segments, sent early
        yield from self._reduce_scatter(flat, gather_sends)
        if gather_recvs is None:  # they land where the reduce-scatter's sends read from
            gather_recvs = self._post_gather(flat)
        yield from self._all_gather(flat, gather_sends, gather_recvs)
        if self.shared is not None:  # nobody writes a shared slot again before all have read
            yield self.dp_comm.Ibarrier()
        if op == "mean":
            flat /= self.dp_size

    def reduce_scatter_steps(self, flat: np.ndarray, op: str = "mean") -> Iterator[MPI.Request]:
        """The reduce-scatter alone, as a generator of requests (like steps): afterwards
        flat[own_range] holds the sum (op="mean": the mean) over the ring, in fp32; the rest of
        `flat` holds partial sums that nobody reads."""
        self._check(flat, op, "allreduce", "reduce_scatter")
        self.last_sent = 0
        if self.dp_size > 1 and self.count > 0:
            yield from self._reduce_scatter(flat, None)
            if self.shared is not None:
                yield self.dp_comm.Ibarrier()
        if op == "mean" and self.dp_size > 1:
            lo, hi = self.own_range
            flat[lo:hi] /= self.dp_size

    def gather_steps(
        self, flat: np.ndarray, master: np.ndarray | None = None
    ) -> Iterator[MPI.Request]:
        """All-gather: every rank's own_range of `flat` to every rank, as a generator of
        requests. master (length of own_range): what the owner sends instead of flat[own_range]
        (its fp32 master weights); lossy codecs encode it once and every rank, the owner
        included, decodes the same bytes into flat, so all replicas end bit-identical."""
        self._check(flat, "sum", "allreduce", "all_gather")
        lo, hi = self.own_range
        if master is not None and master.shape != (hi - lo,):
            raise ValueError(f"master must have the own chunk's length {hi - lo}")
        self.last_sent = 0
        if self.dp_size == 1 or self.count == 0 or not self.compress:
            if master is not None:  # nothing is quantised: the working weights are the master
                flat[lo:hi] = master
            if self.dp_size == 1 or self.count == 0:
                return
        pending = self._post_gather(flat)
        own = (self.dp_rank + 1) % self.dp_size
        sends = []
        for k, (slo, shi, _, _) in enumerate(self.segments[own]):
            if self.compress:
                slot = self._slot(own, k)
                source = flat[slo:shi] if master is None else master[slo - lo : shi - lo]
                self.codec.encode(source, slot)
                self.codec.decode(slot, shi - slo, flat[slo:shi])
            else:
                slot = flat[slo:shi].view(np.uint8)
            sends.append(self._send(slot, TAG_ALL_GATHER, ("ag", own, k)))
        yield from self._all_gather(flat, sends, pending)
        if self.shared is not None:
            yield self.dp_comm.Ibarrier()

    def _send(self, buf: np.ndarray, tag: int, key: tuple) -> MPI.Request:
        """Isend `buf` (through the backend's host copy for `key` on a staging GPU); shared:
        `buf` lies in the shared wire, and only the news that it is written travels."""
        if self.shared is not None:
            self.shared.sync()
            return self.dp_comm.Isend([self._token, MPI.BYTE], self.next_rank, tag)
        wire = self.backend.mpi_send_buffer(buf, (*self._name, *key))
        return self.dp_comm.Isend([wire, MPI.BYTE], self.next_rank, tag)

    def _recv(self, buf: np.ndarray, tag: int, key: tuple) -> MPI.Request:
        """Irecv into `buf`, or its host buffer for `key`: then _received(buf, key) after it.
        Shared: the news that `buf` (in a neighbour's shared wire) is written."""
        if self.shared is not None:
            return self.dp_comm.Irecv([self._token, MPI.BYTE], self.prev_rank, tag)
        wire = self.backend.mpi_recv_buffer(buf, (*self._name, *key))
        return self.dp_comm.Irecv([wire, MPI.BYTE], self.prev_rank, tag)

    def _received(self, buf: np.ndarray, key: tuple) -> None:
        if self.shared is not None:
            self.shared.sync()  # the writer's bytes, seen after its message
            return
        self.backend.finish_recv(buf, (*self._name, *key))

    def _reduce_scatter(
        self, flat: np.ndarray, gather_sends: list[MPI.Request] | None
    ) -> Iterator[MPI.Request]:
        """Pass partial sums round the ring; each hop adds its own contribution. The last hop
        completes a segment of this rank's own chunk, which leaves for the all-gather at once
        (its request joins gather_sends; None: a reduce-scatter alone, the chunk stays here)."""
        p, r, tag = self.dp_size, self.dp_rank, TAG_REDUCE_SCATTER
        recv_chunk = [(r - s - 1) % p for s in range(p - 1)]

        def post(s: int) -> list[MPI.Request]:
            c = recv_chunk[s]
            return [
                self._recv(self._recv_slot(s, c, k), tag, ("rs", c, k))
                for k in range(len(self.segments[c]))
            ]

        # receives first: a large message moves only once its receive is posted, and the
        # neighbour is encoding its own first chunk meanwhile
        pending = post(0)
        sends = [
            self._send(self._encode(flat, r, k, first_use=True), tag, ("rs", r, k))
            for k in range(len(self.segments[r]))
        ]
        sent = self.chunk_nbytes[r]
        for s in range(p - 1):
            c = recv_chunk[s]
            # step s + 1 lands in the other half; step s - 1's half has been consumed
            following = post(s + 1) if s + 1 < p - 1 else []
            for k, request in enumerate(pending):
                yield request
                lo, hi, _, _ = self.segments[c][k]
                received = self._recv_slot(s, c, k)
                self._received(received, ("rs", c, k))
                if s + 1 < p - 1:  # this segment is what we pass on next step
                    residual = self._residual_of(c, k)
                    self.codec.decode_add(received, hi - lo, flat[lo:hi], residual)
                    sends.append(self._send(self._encode(flat, c, k), tag, ("rs", c, k)))
                elif gather_sends is None:  # exact: nobody encodes the owner's sum again
                    residual = self._residual_of(c, k)
                    self.codec.decode_add(received, hi - lo, flat[lo:hi], residual)
                    if residual is not None:
                        residual[...] = 0.0  # its error is spent, none is made here
                else:
                    own = self._own_segment(flat, received, c, k)
                    gather_sends.append(self._send(own, TAG_ALL_GATHER, ("ag", c, k)))
            if s + 1 < p - 1:
                sent += self.chunk_nbytes[c]
            pending = following
        yield from sends
        self.bytes_sent["reduce_scatter"] += sent
        self.last_sent += sent

    def _own_segment(self, flat: np.ndarray, received: np.ndarray, c: int, k: int) -> np.ndarray:
        """Segment k of this rank's own chunk c after the last reduce-scatter hop: the bytes the
        all-gather sends. Lossy: the hop's add, the one encoding and the owner's decoding of its
        own bytes (like everyone else's) are one codec pass."""
        lo, hi, _, _ = self.segments[c][k]
        residual = self._residual_of(c, k)
        if not self.compress:
            self.codec.decode_add(received, hi - lo, flat[lo:hi], residual)
            return flat[lo:hi].view(np.uint8)
        slot = self._slot(c, k)
        self.codec.reduce_encode(received, flat[lo:hi], slot, residual)
        return slot

    def _post_gather(self, flat: np.ndarray) -> list[list[MPI.Request]]:
        """The all-gather's receives, per step and segment: every chunk but our own is received
        once, into its landing place."""
        p, r = self.dp_size, self.dp_rank
        return [
            [
                self._recv(self._landing(flat, c, k), TAG_ALL_GATHER, ("ag", c, k))
                for k in range(len(self.segments[c]))
            ]
            for c in ((r - s) % p for s in range(p - 1))
        ]

    def _all_gather(
        self, flat: np.ndarray, sends: list[MPI.Request], pending: list[list[MPI.Request]]
    ) -> Iterator[MPI.Request]:
        """The owner's encoded chunk (already on its way: `sends`) goes round the ring
        unchanged; every other chunk is received (`pending`), forwarded and decoded."""
        p, r, tag = self.dp_size, self.dp_rank, TAG_ALL_GATHER
        own = (r + 1) % p
        recv_chunk = [(r - s) % p for s in range(p - 1)]
        sent = self.chunk_nbytes[own]
        for s in range(p - 1):
            c = recv_chunk[s]
            for k, request in enumerate(pending[s]):
                yield request
                self._received(self._landing(flat, c, k), ("ag", c, k))
                if s + 1 < p - 1:  # forward the bytes as they came
                    sends.append(self._send(self._landing(flat, c, k), tag, ("ag", c, k)))
                if self.compress:
                    self._decode(flat, c, k)
            if s + 1 < p - 1:
                sent += self.chunk_nbytes[c]
        yield from sends
        self.bytes_sent["all_gather"] += sent
        self.last_sent += sent

    def _landing(self, flat: np.ndarray, c: int, k: int) -> np.ndarray:
        """Where segment k of chunk c arrives in the all-gather: its slot in the gather wire, or
        (fp32) the vector itself."""
        if self.compress:
            _, _, offset, nbytes = self.segments[c][k]
            # shared: the owner's slot, read by every rank in turn (the owner of chunk c is
            # the rank whose reduce-scatter ends with it)
            wire = (
                self.gather_wire if self.shared is None else self.shared.of((c - 1) % self.dp_size)
            )
            return wire[offset : offset + nbytes]
        lo, hi, _, _ = self.segments[c][k]
        return flat[lo:hi].view(np.uint8)

    def _decode(self, flat: np.ndarray, c: int, k: int) -> None:
        lo, hi, _, _ = self.segments[c][k]
        self.codec.decode(self._landing(flat, c, k), hi - lo, flat[lo:hi])

    def close(self) -> None:
        """Free the shared wire, if any (collective over dp_comm), and the backend's host staging
        of this ring; the ring is unusable after."""
        if self.shared is not None:
            self.shared.close()
        self.backend.drop_staging(self._name)
