"""An `mpiexec` command line that works with whichever MPI is installed (tests, benchmarks).

    mpiexec_command(4, sys.executable, "-m", "mpihybrid", "train")
    # MPICH:    [".../mpiexec", "-n", "4", python, "-m", "mpihybrid", "train"]
    # Open MPI: [".../mpiexec", "-n", "4", "--oversubscribe", "--quiet", (root:
    #            "--allow-run-as-root",) python, ...]

The MPI is told by `mpiexec --version`. MPICH's Hydra (and Intel MPI, MVAPICH: Hydra too) starts
as many ranks as asked on any machine and runs as any user. Open MPI refuses more ranks than the
host has cores ("There are not enough slots available") unless told `--oversubscribe`, and
refuses to run as root unless told `--allow-run-as-root`; a test that starts 3 ranks on a 2-core
machine, or a CI container that runs as root, needs both. `--quiet`: when a rank exits non-zero
Open MPI's mpiexec prints a banner of its own ("Primary job terminated normally, but 1 process
returned a non-zero exit code"); quiet, a run's stderr is the run's (one line for bad input),
and the exit code is the same.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

MPICH, OPEN_MPI, UNKNOWN = "MPICH", "Open MPI", "unknown"


def find_mpiexec() -> str:
    """The mpiexec beside this Python (the mpich wheel's, or a site's venv), else on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("mpiexec not found: pip install '.[mpich]' or load your site's MPI")
    return found


@functools.cache
def mpi_flavour(mpiexec: str) -> str:
    """MPICH, Open MPI or unknown, from what `mpiexec --version` prints."""
    try:
        proc = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    return flavour_of(proc.stdout + proc.stderr)


def flavour_of(version_text: str) -> str:
    """The MPI named by `mpiexec --version`'s output."""
    if "Open MPI" in version_text or "OpenRTE" in version_text:  # 5.x, 4.x
        return OPEN_MPI
    if "HYDRA" in version_text or "Intel(R) MPI" in version_text:
        return MPICH
    return UNKNOWN


def launch_options(flavour: str, root: bool | None = None) -> list[str]:
    """What `flavour`'s mpiexec needs to start any number of ranks here, as this user."""
    if flavour != OPEN_MPI:
        return []
    root = os.geteuid() == 0 if root is None else root
    return ["--oversubscribe", "--quiet", *(["--allow-run-as-root"] if root else [])]


def mpiexec_command(n: int, *argv: str, mpiexec: str | None = None) -> list[str]:
    """`mpiexec -n N [what this MPI needs] ARGV...` as a list."""
    mpiexec = mpiexec or find_mpiexec()
    return [mpiexec, "-n", str(n), *launch_options(mpi_flavour(mpiexec)), *argv]


def yield_when_idle(flavour: str) -> dict[str, str]:
    """Environment that makes a rank waiting on a message give its core away, for runs with more
    ranks than cores (the tests: up to 12 ranks on 2 cores). By default both MPIs spin: a waiting
    rank polls and holds its core from the rank it waits for. MPICH yields after every poll and
    sleeps a microsecond after a poll that found nothing (the settings MPICH's own CI gives
    oversubscribed mpi4py runs); Open MPI is told `mpi_yield_when_idle`. Not for timed runs on
    a core per rank: polling answers a message sooner."""
    if flavour == MPICH:
        return {
            "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
            "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
            "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
        }
    if flavour == OPEN_MPI:
        return {"OMPI_MCA_mpi_yield_when_idle": "1"}
    return {}


# what an MPI launcher puts in its ranks' environment (MPICH/Hydra, Open MPI, PMIx); a child
# process that keeps them would take itself for a rank of the job
LAUNCHER_PREFIXES = ("PMI", "HYDRA", "OMPI_", "PMIX_", "ORTE_", "OPAL_")


def without_launcher(environ: dict[str, str]) -> dict[str, str]:
    """`environ` less every MPI launcher's variables: for a plain child process of a rank."""
    return {k: v for k, v in environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
