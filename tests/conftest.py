"""Tells tests/helpers.py which markers the running test carries (mpiexec needs `mpi`).

Set before any fixture of the test runs, so a module-scoped fixture that launches mpiexec is
checked against the first test that uses it.
"""

from __future__ import annotations

import fnmatch
import os

import pytest

from tests import helpers

# Ranks and CLI subprocesses run OpenBLAS's own kernel set, as this process does: a cached
# `bench blas --save` choice (mpihybrid/_blas.py) reaches only processes that import mpihybrid
# before numpy, and tests compare in-process numpy with the ranks bit for bit.
os.environ["MPIHYBRID_BLAS"] = "off"


def pytest_runtest_setup(item):
    helpers.current_markers = {m.name for m in item.iter_markers()}


def pytest_runtest_teardown(item):
    helpers.current_markers = None


# `one_mpi`: MPI tests whose outcome no MPI implementation changes, run under the first MPI only
# (.ci/run's Open MPI leg is `-m "mpi and not one_mpi"`; every MPI test runs under MPICH). Each
# group keeps at least one case that runs under every MPI. By node id (fnmatch), with the reason:
ONE_MPI = {
    # config checks before any message: every rank runs the same pure check; the agreement on
    # the first error and the one line stay tested under every MPI by the cases not listed
    "tests/test_bad_input.py::test_bad_input_exits_2_with_one_line[[]4-args[3-9]*": "config",
    "tests/test_bad_input.py::test_bad_input_exits_2_with_one_line[[]2-args1[1235789]-*": "config",
    "tests/test_bad_input.py::test_bad_input_exits_2_with_one_line[[]2-args2*": "config",
    "tests/test_bad_input.py::test_bench_allreduce_bad_arguments*": "config",
    "tests/test_sweep.py::test_bad_input_exits_2_on_every_rank*[[]args[1-8]-*": "config",
    "tests/test_sweep.py::test_existing_output_is_refused": "config",
    "tests/test_checkpoint.py::test_checkpoint_of_another_pp_is_refused": "config",
    "tests/test_checkpoint.py::test_foreign_manifest_is_refused": "config",
    "tests/test_checkpoint.py::test_resume_without_checkpoint_is_refused": "config",
    # what the CLI reads from a trace an MPI test wrote (its writing runs under every MPI)
    "tests/test_cli_trace.py::test_timeline_*": "a written trace",
    "tests/test_cli_trace.py::test_export_*": "a written trace",
    "tests/test_cli_trace.py::test_bad_trace_is_one_error_line*": "a written trace",
    "tests/test_analysis.py::test_format_and_json": "a written trace",
    "tests/test_analysis.py::test_allreduce_bandwidth_follows_nccl_tests": "a written trace",
    "tests/test_sweep.py::test_tiny_sweep_draws_real_pngs": "a written trace",
    # learning curves and benchmarks' own figures: numbers the MPI does not enter
    "tests/test_train.py::test_seed_job_learns_and_int8_tracks_fp32": "learning",
    "tests/test_gpt.py::test_learnable_job_learns": "learning",
    "tests/test_trace_overhead.py::test_overhead_benchmark_prints_the_ratios": "benchmark",
    "tests/test_memory_cgroup.py::*": "the kernel's cgroup",
    # the same messages as the cases kept: more schedules of one kind, another size
    "tests/test_search_train.py::test_auto_equals_serial[[]4-1-8-mlp]": "a larger case",
    "tests/test_checkpoint.py::test_resume_is_bit_identical[[]3-int8-sgd]": "a larger case",
    "tests/test_checkpoint.py::test_resume_is_bit_identical[[]7-fp32-adamw]": "a larger case",
    "tests/test_schedules_train.py::test_new_schedules_equal_serial[[]4-1-8-*": "a larger case",
    "tests/test_gpt.py::test_gpt_hybrid_equals_serial[[]4-1-2-*": "a larger case",
    "tests/test_gpt.py::test_gpt_hybrid_equals_serial[[]3-1-4-*": "a larger case",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(fnmatch.fnmatchcase(item.nodeid, pattern) for pattern in ONE_MPI):
            item.add_marker(pytest.mark.one_mpi)
