"""Rank 1 kills itself (SIGKILL) halfway through writing the second checkpoint (under mpiexec)."""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from mpihybrid import cli  # noqa: E402
from mpihybrid.train import checkpoint  # noqa: E402

if MPI.COMM_WORLD.rank == 1:
    original = checkpoint.stages.save_rank

    def dying_save_rank(partial, state, dp_rank, step):
        if step == 8:
            with open(partial / f"stage-{state.index:03d}.h5", "wb") as f:
                f.write(b"\x89HDF\r\n half a file")  # a torn write, then death
            os.kill(os.getpid(), signal.SIGKILL)
        return original(partial, state, dp_rank, step)

    checkpoint.stages.save_rank = dying_save_rank

cli.main(sys.argv[1:])
