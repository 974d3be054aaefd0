"""BLAS threads per rank: the cores a rank has, not every core of the node.

numpy's BLAS starts one thread per core of the machine. Under mpiexec every rank does so, and
N ranks on N cores then run N x N threads that fight each other: on a 2-core machine the GPT
benchmark ran 5x slower than with one thread per rank. So when an MPI launcher started this
process and nobody chose a thread count, `limit_blas_threads` chooses one before numpy loads
its BLAS (the library reads the variables once, when it loads):

    a rank bound to some cores (srun, mpiexec --bind-to core)  -> that many threads
    unbound                                                   -> cores // ranks on this node

Whatever the user set (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS) stands.
Standard library only: this runs before numpy is imported.
"""

from __future__ import annotations

import os
import sys

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# ranks on this node, as MPICH/Hydra, Open MPI, MVAPICH and SLURM's srun announce them
LOCAL_SIZE_VARS = (
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE",
    "SLURM_STEP_TASKS_PER_NODE",
)


def _local_size(environ) -> int | None:
    for name in LOCAL_SIZE_VARS:
        value = environ.get(name, "")
        # srun writes "4(x2)" for 4 tasks on each of 2 nodes, "4,3" for uneven nodes (then the
        # first count may not be ours; srun binds ranks to cores anyway, see blas_threads)
        digits = value.split("(")[0].split(",")[0]
        if digits.isdigit() and int(digits) > 0:
            return int(digits)
    return None


def blas_threads(environ, bound_cores: int, node_cores: int) -> int | None:
    """The thread count to set, or None to leave the BLAS as it is.

    bound_cores: cores this process may run on (its affinity mask); node_cores: the node's.
    """
    if any(environ.get(name) for name in THREAD_VARS):
        return None  # the user's choice
    local = _local_size(environ)
    if local is None:
        return None  # not started by an MPI launcher: one process may use the whole machine
    if bound_cores < node_cores:  # the launcher pinned this rank: use what it was given
        return max(1, bound_cores)
    return max(1, node_cores // local)


def limit_blas_threads(environ=os.environ) -> int | None:
    """Set the thread variables when blas_threads says so and numpy has not loaded yet."""
    if "numpy" in sys.modules:
        return None  # too late to matter: the BLAS read its variables already
    node = os.cpu_count() or 1
    bound = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else node
    threads = blas_threads(environ, bound, node)
    if threads is not None:
        for name in THREAD_VARS:
            environ[name] = str(threads)
    return threads
