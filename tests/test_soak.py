"""A long run's memory does not grow with its steps (issue #41: rank 0's RSS grew ~255 bytes a
step: per-step Python lists of losses and accuracies, and every step's trace rows of a run
without a trace file). Counts Python's allocations (tracemalloc) after N, 2N and 3N steps of
one run (benchmarks/soak_growth.py, MPI's singleton: no mpiexec); no timing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, mpi_env


@pytest.mark.parametrize("traced", [True, False])
def test_python_memory_is_flat_over_the_steps(tmp_path, traced):
    trace = ["--set", f"trace.path={tmp_path / 's.h5'}"] if traced else []
    proc = subprocess.run(
        [sys.executable, "benchmarks/soak_growth.py", "--steps", "400", "--json", *trace],
        capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    print(out)
    # before: 64 bytes a step with a trace (two Python floats and their list slots), 1.6 KB
    # without one (every step's event rows). The first interval still fills fixed rings (the
    # flight record's 512 rows take step numbers past Python's small ints, the untraced run's
    # last-steps window reaches its size); later ones grow only by a few objects. A leak grows
    # in every interval; a table that doubles once (h5py's object registry: one 9 KB block when
    # the trace's events gained a column) lands in one of them: the smaller of the last two.
    assert min(out["python_bytes_per_step"][1:]) < 16, out  # 6 KB over 400 steps
