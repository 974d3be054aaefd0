"""Hand-written ring all-reduce over dp_comm: reduce-scatter then all-gather, on Sendrecv.

    ring = RingAllreduce(grid.dp_comm, flat_grad.size, get_codec("int8"))
    sent = ring(flat_grad, op="mean")       # in place; the bytes this rank sent

p = dp_size ranks, the vector cut into p chunks (np.array_split bounds). Ring neighbours:
rank r sends to (r + 1) % p and receives from (r - 1) % p.
    reduce-scatter, step s = 0..p-2: send chunk (r - s) % p, receive chunk (r - s - 1) % p and
        add it to our own; afterwards rank r holds the full sum of chunk (r + 1) % p.
    all-gather, step s = 0..p-2: send chunk (r + 1 - s) % p, receive chunk (r - s) % p.

Compressed (lossy codec): every chunk that goes on the wire is encoded once, by the rank that
computed it. In the all-gather the owner encodes its reduced chunk once and those exact bytes go
round the ring unchanged; every rank, the owner included, decodes the same bytes, so all replicas
end bit-identical. Error feedback: `residual` (this rank's encoding error per element) is added to
the input before the ring; each chunk is encoded by this rank exactly once per call and its new
error replaces the residual there, so errors telescope into the next call instead of piling up.
With p = 1 nothing travels and nothing is quantised: the call leaves the vector as it is.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.codecs import Codec

# the ring's message tags on dp_comm (its own communicator: no clash with pipeline tags)
TAG_REDUCE_SCATTER = 101
TAG_ALL_GATHER = 102


def chunk_bounds(count: int, parts: int) -> np.ndarray:
    """Start offsets of `parts` chunks plus the end, like np.array_split: bounds[i]..bounds[i+1]."""
    base, extra = divmod(count, parts)
    i = np.arange(parts + 1)
    return i * base + np.minimum(i, extra)


class RingAllreduce:
    """In-place all-reduce of one float32 vector of fixed length over `dp_comm`."""

    def __init__(
        self, dp_comm: MPI.Comm, count: int, codec: Codec, error_feedback: bool = True
    ) -> None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.dp_comm = dp_comm
        self.count = count
        self.codec = codec
        self.dp_rank = dp_comm.Get_rank()
        self.dp_size = dp_comm.Get_size()
        self.next_rank = (self.dp_rank + 1) % self.dp_size
        self.prev_rank = (self.dp_rank - 1) % self.dp_size
        self.bytes_sent: dict[str, int] = {"reduce_scatter": 0, "all_gather": 0}

        p = self.dp_size
        self.bounds = [int(b) for b in chunk_bounds(count, p)]
        sizes = [self.bounds[c + 1] - self.bounds[c] for c in range(p)]
        self.chunk_nbytes = [codec.nbytes(n) for n in sizes]
        # wire offsets: chunk c's encoded bytes at wire[wire_bounds[c]:wire_bounds[c + 1]];
        # each start rounded up to 8 bytes so that the float views of a slot stay aligned
        starts = np.zeros(p + 1, np.int64)
        starts[1:] = np.cumsum([(n + 7) // 8 * 8 for n in self.chunk_nbytes])
        self.wire_bounds = [int(s) for s in starts]
        self.compress = codec.lossy and p > 1 and count > 0
        # fp32 sends straight from the vector; lossy codecs encode each chunk into its wire slot
        self.wire = np.empty(self.wire_bounds[-1] if self.compress else 0, np.uint8)
        self.recv_buf = np.empty(max(self.chunk_nbytes), np.uint8)
        self.decoded = np.empty(max(sizes) if self.compress else 0, np.float32)
        self.residual: np.ndarray | None = None
        if codec.lossy and error_feedback:
            self.residual = np.zeros(count, np.float32)

    def _chunk(self, flat: np.ndarray, c: int) -> np.ndarray:
        return flat[self.bounds[c] : self.bounds[c + 1]]

    def _slot(self, c: int) -> np.ndarray:
        """Chunk c's encoded bytes in the wire buffer."""
        start = self.wire_bounds[c]
        return self.wire[start : start + self.chunk_nbytes[c]]

    def _encode(self, flat: np.ndarray, c: int) -> np.ndarray:
        """The bytes to send for chunk c of `flat`; lossy: encoded once, error kept as residual."""
        values = self._chunk(flat, c)
        if not self.compress:
            return values.view(np.uint8)
        slot = self._slot(c)
        self.codec.encode(values, slot)
        if self.residual is not None:
            decoded = self.decoded[: len(values)]
            self.codec.decode(slot, len(values), decoded)
            np.subtract(values, decoded, out=self._chunk(self.residual, c))
        return slot

    def _sendrecv(self, send: np.ndarray, recv: np.ndarray, tag: int) -> None:
        self.dp_comm.Sendrecv(
            [send, MPI.BYTE], self.next_rank, tag, [recv, MPI.BYTE], self.prev_rank, tag
        )

    def __call__(self, flat: np.ndarray, op: str = "mean") -> int:
        """All-reduce `flat` (float32, length count) in place; returns the bytes this rank sent."""
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        if flat.dtype != np.float32 or flat.shape != (self.count,) or not flat.flags.c_contiguous:
            raise ValueError(
                f"expected a contiguous float32 vector of length {self.count}, "
                f"got {flat.dtype} {flat.shape}"
            )
        p, r = self.dp_size, self.dp_rank
        if p == 1 or self.count == 0:
            return 0
        if self.residual is not None:
            flat += self.residual

        # reduce-scatter: pass partial sums round the ring, each hop adds its own contribution
        rs_bytes = 0
        for s in range(p - 1):
            send_c, recv_c = (r - s) % p, (r - s - 1) % p
            recv = self.recv_buf[: self.chunk_nbytes[recv_c]]
            self._sendrecv(self._encode(flat, send_c), recv, TAG_REDUCE_SCATTER)
            recv_values = self._chunk(flat, recv_c)
            self.codec.decode_add(recv, len(recv_values), recv_values)
            rs_bytes += self.chunk_nbytes[send_c]

        # all-gather: the owner encodes its reduced chunk once; the bytes are forwarded as they are
        ag_bytes = 0
        own_c = (r + 1) % p
        self._encode(flat, own_c)
        for s in range(p - 1):
            send_c, recv_c = (r + 1 - s) % p, (r - s) % p
            if self.compress:
                send, recv = self._slot(send_c), self._slot(recv_c)
            else:
                send, recv = self._chunk(flat, send_c).view(np.uint8), self._chunk(flat, recv_c)
                recv = recv.view(np.uint8)
            self._sendrecv(send, recv, TAG_ALL_GATHER)
            ag_bytes += self.chunk_nbytes[send_c]
        if self.compress:
            # every rank, the owner included, decodes the same bytes
            for c in range(p):
                values = self._chunk(flat, c)
                self.codec.decode(self._slot(c), len(values), values)

        if op == "mean":
            flat /= p
        self.bytes_sent["reduce_scatter"] += rs_bytes
        self.bytes_sent["all_gather"] += ag_bytes
        return rs_bytes + ag_bytes
