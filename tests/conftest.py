"""Tells tests/helpers.py which markers the running test carries (mpiexec needs `mpi`).

Set before any fixture of the test runs, so a module-scoped fixture that launches mpiexec is
checked against the first test that uses it.
"""

from __future__ import annotations

import os

from tests import helpers

# Ranks and CLI subprocesses run OpenBLAS's own kernel set, as this process does: a cached
# `bench blas --save` choice (mpihybrid/_blas.py) reaches only processes that import mpihybrid
# before numpy, and tests compare in-process numpy with the ranks bit for bit.
os.environ["MPIHYBRID_BLAS"] = "off"


def pytest_runtest_setup(item):
    helpers.current_markers = {m.name for m in item.iter_markers()}


def pytest_runtest_teardown(item):
    helpers.current_markers = None
