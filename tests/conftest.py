"""Tells tests/helpers.py which markers the running test carries (mpiexec needs `mpi`).

Set before any fixture of the test runs, so a module-scoped fixture that launches mpiexec is
checked against the first test that uses it.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

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


# `every_mpi`: the MPI tests that .ci/run runs a second time under Open MPI (`-m every_mpi`);
# every MPI test runs under MPICH. Each MPI path the program takes keeps its cheapest cases here
# (the MPI calls, launcher, signals and exits an implementation may do differently); the cases
# left out repeat those calls with other schedules, sizes, configs or figures. By node id
# (fnmatch: `[[]` is a literal "["), with the path each covers:
EVERY_MPI = {
    # the hand-written ring and the MPI_Allreduce it is measured against; odd ranks
    "tests/test_allreduce.py::test_ring_allreduce[[][23]]": "ring all-reduce, every codec",
    "tests/test_allreduce.py::test_bench_runs_every_codec_against_mpi": "MPI_Allreduce",
    "tests/test_allreduce.py::test_bench_allreduce_transport_option": "ring transports",
    "tests/test_codecs.py::test_bench_codecs_under_mpiexec_prints_once": "output of N ranks",
    "tests/test_shaped_link.py::*": "ring across a shaped link",
    # pipelines: Send/Recv at every placement, data-inner, 12 ranks oversubscribed, Ssend
    "tests/test_train.py::test_hybrid_equals_serial[[]2-2-naive*": "p2p, pipeline-inner",
    "tests/test_train.py::test_hybrid_equals_serial[[]2-2-1f1b-data-inner]": "p2p, data-inner",
    "tests/test_train.py::test_hybrid_equals_serial[[]3-4-*": "12 ranks on 2 cores",
    "tests/test_train.py::test_sync_sends_never_rely_on_eager_buffering": "synchronous sends",
    "tests/test_train.py::test_trace_holds_every_event_the_schedule_implies": "trace gather",
    "tests/test_schedules_train.py::test_new_schedules_equal_serial[[]2-2-4-zb-h2*": "V, csv",
    "tests/test_schedules_train.py::test_new_schedules_equal_serial[[]2-2-4-zb-v,*-gpt]": "GPT V",
    "tests/test_gpt.py::test_gpt_hybrid_equals_serial[[]2-2-4-cost-*": "GPT, dp 2",
    "tests/test_gpt.py::test_bench_train_reports_consistent_figures": "bench train",
    "tests/test_search_train.py::test_auto_equals_serial[[]2-1-4-gpt*": "searched lists, bcast",
    "tests/test_sweep.py::test_tiny_sweep_writes_one_sane_row_per_run": "sweep's communicators",
    "tests/test_text.py::test_text_hybrid_equals_serial": "token data",
    "tests/test_text.py::test_bad_token_data_stops_every_rank_before_a_step": "token data",
    # traces: clocks, gathering, what MPI reports of itself, a full disk
    "tests/test_analysis.py::*": "a traced run",
    "tests/test_trace.py::test_gather_events_and_clock_offsets[[][34]]": "clock offsets",
    "tests/test_trace_doc.py::*": "what MPI says of itself",
    "tests/test_trace_stream.py::*": "a preempted trace",
    "tests/test_files_trace.py::*": "a full trace disk",
    "tests/test_files_lock.py::test_a_second_run_on_a_locked_*": "file locks",
    # errors, exits and signals: one line on every rank, mpiexec's exit code, kills
    "tests/test_bad_input.py::test_bad_input_exits_2_with_one_line[[]8-args0-*": "world size",
    "tests/test_bad_input.py::test_malformed_toml": "exit 2",
    "tests/test_bad_input.py::test_usage_error_is_printed_once": "exit 2",
    "tests/test_bad_input.py::test_existing_trace_is_not_overwritten": "exit 2",
    "tests/test_bad_input.py::test_a_rank_failing_mid_run_ends_the_job": "abort",
    "tests/test_bad_input.py::test_debug_shows_the_failing_ranks_traceback": "abort",
    "tests/test_bad_input.py::test_a_rank_killed_by_the_os_ends_the_job": "a killed rank",
    "tests/test_watchdog.py::test_sigint_to_mpiexec_*": "the launcher's signals",
    "tests/test_watchdog.py::test_one_rank_interrupted_or_leaving_*": "one rank's exit",
    "tests/test_watchdog.py::test_a_stalled_rank_is_named_*": "the watchdog",
    "tests/test_watchdog.py::test_an_evaluation_longer_*[[]1]": "watchdog",
    "tests/test_watchdog.py::test_signals_*": "signals at the edges",
    "tests/test_watchdog.py::test_a_signal_while_the_model_is_built_*": "signals at the edges",
    # checkpoints: resume, preemption, kill -9, a failing commit, a full disk, NaN
    "tests/test_checkpoint.py::test_resume_is_bit_identical[[]3-int8-sgd]": "resume",
    "tests/test_checkpoint.py::test_resume_with_another_dp": "resume at another dp",
    "tests/test_checkpoint.py::test_preemption_signal_checkpoints_and_exits_3": "SIGUSR1",
    "tests/test_checkpoint.py::test_kill_9_during_a_checkpoint_*": "kill -9",
    "tests/test_checkpoint.py::test_commit_failing_on_rank_0_ends_every_rank": "abort",
    "tests/test_checkpoint.py::test_full_disk_keeps_the_earlier_checkpoint": "a full disk",
    "tests/test_checkpoint.py::test_diverging_run_stops_and_never_checkpoints_nan": "NaN",
    "tests/test_checkpoint.py::test_nonfinite_gradient_names_step_and_stage": "NaN",
    # node detection, the two-level ring, codecs on the pipeline wire
    "tests/test_nodes.py::test_p2p_codec_fp32_is_today_and_lossy_is_deterministic": "p2p codec",
    "tests/test_nodes.py::test_two_level_ring_equals_the_flat_ring[[]0,[01],1]": "two-level",
    "tests/test_nodes.py::test_two_level_training_keeps_replicas_identical": "two-level",
    "tests/test_two_nodes.py::*": "two nodes (MPICH's harness: says why it skips)",
    "tests/test_threads.py::*": "the launcher's core binding",
    # devices (the fake GPU): staging buffers, local ranks, agreement on CUDA-awareness
    "tests/test_device.py::*": "device staging, local rank",
    "tests/test_device_train.py::test_staged_device_training_*[[]4-jobs*": "staged training",
    "tests/test_device_train.py::test_ring_on_the_device_sends_only_encoded_bytes": "device ring",
    "tests/test_device_train.py::test_cuda_without_a_gpu_or_cupy_is_one_clear_error": "exit 2",
    # the sharded optimizer's gathers, global-norm clipping, the tied embedding's group
    "tests/test_zero.py::test_the_weight_gather_*": "weight gather",
    "tests/test_zero.py::test_rings_allocate_*": "sharded rings",
    "tests/test_zero.py::test_shards_that_do_not_cover_the_stage_are_refused": "exit 2",
    "tests/test_clip.py::test_clipped_run_equals_serial_under_every_schedule[[]2]": "the norm",
    "tests/test_tie.py::*": "the embedding group",
}


def pytest_collection_modifyitems(config, items):
    matched = set()
    for item in items:
        if item.get_closest_marker("mpi") is None:
            continue
        hits = {p for p in EVERY_MPI if fnmatch.fnmatchcase(item.nodeid, p)}
        if hits:
            item.add_marker(pytest.mark.every_mpi)
            matched |= hits
    # with every test module collected, a pattern that matches no MPI test (a renamed test or
    # case) would silently drop a path from the Open MPI leg: stop instead
    modules = {Path(item.fspath).name for item in items}
    if modules >= {p.name for p in Path(__file__).parent.glob("test_*.py")}:
        stale = sorted(set(EVERY_MPI) - matched)
        if stale:
            raise pytest.UsageError(f"tests/conftest.py EVERY_MPI matches no MPI test: {stale}")
