"""An mpiexec command line for whichever MPI is installed (mpihybrid/launch.py), without MPI."""

from __future__ import annotations

import pytest

from mpihybrid.launch import (
    MPICH,
    OPEN_MPI,
    UNKNOWN,
    flavour_of,
    launch_options,
    mpi_flavour,
    mpiexec_command,
    without_launcher,
    yield_when_idle,
)
from tests import helpers

HYDRA = "HYDRA build details:\n    Version:                                 4.2.0\n"
OPENRTE = "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n"


@pytest.mark.parametrize(
    "text, flavour",
    [(HYDRA, MPICH), (OPENRTE, OPEN_MPI), ("mpiexec (Open MPI) 5.0.3\n", OPEN_MPI),
     ("Intel(R) MPI Library for Linux* OS, Version 2021.10", MPICH), ("", UNKNOWN),
     ("srun: unrecognized option '--version'", UNKNOWN)],
)  # fmt: skip
def test_the_mpi_is_told_by_its_version_text(text, flavour):
    assert flavour_of(text) == flavour


def test_open_mpi_is_told_to_oversubscribe_and_as_root_that_root_may_run_it():
    quiet = ["--oversubscribe", "--quiet"]  # quiet: no banner of mpiexec's after a failed rank
    assert launch_options(OPEN_MPI, root=False) == quiet
    assert launch_options(OPEN_MPI, root=True) == [*quiet, "--allow-run-as-root"]
    assert launch_options(MPICH, root=True) == [] and launch_options(UNKNOWN, root=True) == []


def test_the_command_asks_the_launcher_it_runs(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\nprintf '{OPENRTE}'\n")
    fake.chmod(0o755)
    assert mpi_flavour(str(fake)) == OPEN_MPI
    cmd = mpiexec_command(3, "python", "x.py", mpiexec=str(fake))
    assert cmd[:4] == [str(fake), "-n", "3", "--oversubscribe"] and cmd[-2:] == ["python", "x.py"]
    assert mpi_flavour(str(tmp_path / "missing")) == UNKNOWN  # no launcher there: no options


def test_a_child_of_a_rank_loses_the_launchers_variables():
    env = {"PMI_RANK": "1", "HYDRA_CONTROL_FD": "3", "OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1",
           "ORTE_HNP": "x", "OPAL_PREFIX": "/usr", "PATH": "/bin", "HOME": "/"}  # fmt: skip
    assert without_launcher(env) == {"PATH": "/bin", "HOME": "/"}


def test_waiting_ranks_yield_in_the_tests_and_a_users_setting_wins(monkeypatch):
    mpich = yield_when_idle(MPICH)
    assert mpich["MPIR_CVAR_POLLS_BEFORE_YIELD"] == "1"
    assert mpich["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] == "1"
    assert yield_when_idle(OPEN_MPI) == {"OMPI_MCA_mpi_yield_when_idle": "1"}
    assert yield_when_idle(UNKNOWN) == {}
    monkeypatch.setattr(helpers, "flavour", lambda: MPICH)
    monkeypatch.setenv("MPIR_CVAR_POLLS_BEFORE_YIELD", "1000")
    env = helpers.mpi_env()
    assert env["MPIR_CVAR_POLLS_BEFORE_YIELD"] == "1000"  # the caller's own
    assert env["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"
