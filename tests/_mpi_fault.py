"""Rank 1 raises in its third forward; the CLI must abort the whole job (run under mpiexec)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from mpihybrid import cli  # noqa: E402
from mpihybrid.nn import model  # noqa: E402

if MPI.COMM_WORLD.rank == 1:
    original = model.Stage.forward
    calls = {"n": 0}

    def failing_forward(self, x):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return original(self, x)

    model.Stage.forward = failing_forward

cli.main(["train", "--quiet", "--set", "train.steps=50"], standalone_mode=True)
