"""One BLAS thread per core a rank owns, chosen before numpy loads, unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpihybrid._threads import THREAD_VARS, blas_threads, limit_blas_threads
from tests.helpers import ROOT, mpi_command, mpi_env


@pytest.mark.parametrize(
    "environ, bound, node, want",
    [
        ({"MPI_LOCALNRANKS": "2"}, 2, 2, 1),  # mpiexec -n 2 on 2 cores
        ({"MPI_LOCALNRANKS": "4"}, 16, 16, 4),
        ({"MPI_LOCALNRANKS": "12"}, 2, 2, 1),  # oversubscribed: never 0
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 12, 12, 4),
        ({"MV2_COMM_WORLD_LOCAL_SIZE": "8"}, 64, 64, 8),
        ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, 32, 32, 8),
        ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, 8, 32, 8),  # srun bound the rank to 8 cores
        ({"MPI_LOCALNRANKS": "2"}, 1, 2, 1),  # mpiexec --bind-to core
        ({}, 16, 16, None),  # no launcher: one process may use the machine
        ({"MPI_LOCALNRANKS": "2", "OMP_NUM_THREADS": "3"}, 2, 2, None),  # the user's choice
        ({"MPI_LOCALNRANKS": "2", "MKL_NUM_THREADS": "1"}, 2, 2, None),
        ({"MPI_LOCALNRANKS": "x"}, 4, 4, None),
    ],
)
def test_blas_threads(environ, bound, node, want):
    assert blas_threads(environ, bound, node) == want


def test_limit_sets_every_variable_only_before_numpy(monkeypatch):
    import numpy  # noqa: F401  loaded: its BLAS has read the variables, setting them is no use

    environ = {"MPI_LOCALNRANKS": str(2 * (os.cpu_count() or 1))}
    assert limit_blas_threads(environ) is None and set(environ) == {"MPI_LOCALNRANKS"}
    monkeypatch.delitem(sys.modules, "numpy")  # as in a rank that has not imported it yet
    assert limit_blas_threads(environ) == 1
    assert all(environ[name] == "1" for name in THREAD_VARS)


def _thread_vars_in_two_ranks(env: dict) -> list[str]:
    code = (
        "import os, mpihybrid._threads as t; from mpi4py import MPI\n"
        "lines = MPI.COMM_WORLD.gather(' '.join(str(os.environ.get(k)) for k in t.THREAD_VARS))\n"
        "if lines: print(*lines, sep='\\n')"  # rank 0 prints for both: no interleaved output
    )
    proc = subprocess.run(
        mpi_command(2, "-c", code), capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.mpi
def test_ranks_share_the_cores_of_the_node():
    env = {k: v for k, v in mpi_env().items() if k not in THREAD_VARS}
    each = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert _thread_vars_in_two_ranks(env) == [" ".join([each] * len(THREAD_VARS))] * 2
    # a count the user set is kept
    assert _thread_vars_in_two_ranks(env | {"OMP_NUM_THREADS": "3"}) == ["3 None None"] * 2
