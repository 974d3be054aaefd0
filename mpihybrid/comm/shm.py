"""Wire buffers that the ranks of one node read from each other directly (MPI-3 shared memory).

    if node_local(comm):
        wire = SharedWire(comm, nbytes)   # collective
        wire.own[...] = encoded           # write, then wire.sync() and tell the reader
        wire.sync(); data = wire.of(peer) # told: read the peer's bytes where they lie
        wire.close()                      # collective

A message between two ranks of one node is copied at least once (MPICH: the receiver reads the
sender's pages with process_vm_readv, or both copy through shared cells). A ring whose encoded
segments lie in a shared window needs no copy at all: the receiver's codec kernel decodes
straight from its neighbour's buffer, and a zero-byte message says when the bytes are there.
`sync` (MPI_Win_sync) orders the writes before the message and the reads after it, as MPI's
shared-memory model asks.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.device import local_rank


def node_local(comm: MPI.Comm) -> bool:
    """Whether every rank of `comm` shares one node's memory (collective). Under MPICH's
    MPIR_CVAR_NOLOCAL=1 every rank counts as a node of its own."""
    return local_rank(comm)[1] == comm.Get_size()


class SharedWire:
    """`nbytes` of shared memory per rank of `comm` (all on one node), each rank's readable by
    all: `own` is this rank's, `of(r)` rank r's."""

    def __init__(self, comm: MPI.Comm, nbytes: int) -> None:
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each rank's buffer on pages of its own
        try:
            self.win = MPI.Win.Allocate_shared(nbytes, 1, info=info, comm=comm)
        finally:
            info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for Win_sync, no locking
        self._views = []
        for rank in range(comm.Get_size()):
            memory, _ = self.win.Shared_query(rank)
            self._views.append(
                np.frombuffer(memory, np.uint8, count=nbytes) if nbytes else np.empty(0, np.uint8)
            )
        self.own = self._views[comm.Get_rank()]

    def of(self, rank: int) -> np.ndarray:
        return self._views[rank]

    def sync(self) -> None:
        self.win.Sync()

    def close(self) -> None:
        """Free the window (collective over the ring's communicator)."""
        if self.win != MPI.WIN_NULL:
            self._views, self.own = [], np.empty(0, np.uint8)
            self.win.Unlock_all()
            self.win.Free()
