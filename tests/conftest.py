"""Tells tests/helpers.py which markers the running test carries (mpiexec needs `mpi`).

Set before any fixture of the test runs, so a module-scoped fixture that launches mpiexec is
checked against the first test that uses it.
"""

from __future__ import annotations

from tests import helpers


def pytest_runtest_setup(item):
    helpers.current_markers = {m.name for m in item.iter_markers()}


def pytest_runtest_teardown(item):
    helpers.current_markers = None
