"""What the tests share: launching real `mpiexec` runs and reading what their rank 0 printed.

    proc = run_mpi(4, "-m", "mpihybrid", "train")      # a finished process, text output
    rows = results(proc)                                 # every `RESULT {json}` line, parsed

A test that launches mpiexec must carry the `mpi` (or `slurm`) marker, so that
`pytest -m "not mpi"` runs the unit tests alone in seconds; mpi_command() checks it
(tests/conftest.py tells it which test is running).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mpihybrid.launch import find_mpiexec, mpi_flavour, mpiexec_command, yield_when_idle

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    """The mpiexec that sits next to this Python (the mpich wheel), else the one on PATH."""
    return find_mpiexec()


def flavour() -> str:
    """The MPI the tests launch: "MPICH", "Open MPI" or "unknown" (from `mpiexec --version`)."""
    return mpi_flavour(mpiexec())


def mpi_env(env: dict | None = None) -> dict:
    """One BLAS thread per rank, waiting ranks that give their core away (tests oversubscribe
    the machine; a setting of the caller's own wins), and this checkout importable."""
    full_env = {**yield_when_idle(flavour()), **os.environ}
    full_env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return full_env


# the running test's marker names, set by tests/conftest.py; None outside pytest
current_markers: set[str] | None = None
LAUNCH_MARKERS = {"mpi", "slurm"}


def mpi_command(n: int, *argv: str) -> list[str]:
    """`mpiexec -n N [what this MPI needs] python ARGV...` as a list; only from a test marked
    mpi (or slurm). Open MPI is told to oversubscribe (3 ranks on 2 cores) and, as root, that
    root may run it (mpihybrid/launch.py)."""
    if current_markers is not None and not current_markers & LAUNCH_MARKERS:
        raise AssertionError("this test launches mpiexec: mark it @pytest.mark.mpi")
    return mpiexec_command(n, sys.executable, *argv)


def run_mpi(
    n: int, *argv: str, timeout: float = 120, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `mpiexec -n N python ARGV...`; returns the finished process (stdout/stderr as text)."""
    return subprocess.run(
        mpi_command(n, *argv),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=mpi_env(env),
        cwd=cwd or ROOT,
    )


def results(proc: subprocess.CompletedProcess) -> list[dict]:
    """The `RESULT {json}` lines rank 0 printed, parsed, in order (the run must have passed)."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    prefix = "RESULT "
    return [json.loads(line[len(prefix) :]) for line in proc.stdout.splitlines()
            if line.startswith(prefix)]  # fmt: skip


def abort_on_exception(exc_type, exc, tb) -> None:
    """An exception on one rank ends every rank (the others would wait in a collective)."""
    sys.__excepthook__(exc_type, exc, tb)
    sys.stderr.flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)
