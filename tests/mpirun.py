"""Launch real `mpiexec` runs from tests: `run_mpi(4, "-m", "mpihybrid", "train")`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    """The mpiexec that sits next to this Python (the mpich wheel), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("mpiexec not found: pip install '.[mpich]' or load your site's MPI")
    return found


def mpi_env(env: dict | None = None) -> dict:
    """One BLAS thread per rank, and this checkout importable."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return full_env


def mpi_command(n: int, *argv: str) -> list[str]:
    return [mpiexec(), "-n", str(n), sys.executable, *argv]


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
