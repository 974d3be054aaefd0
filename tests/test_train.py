"""End-to-end training under real mpiexec: hybrid == serial, the seed job, the trace."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from tests.helpers import results, run_mpi

pytestmark = pytest.mark.mpi

ALL_SCHEDULES = "naive,gpipe,1f1b,interleaved-1f1b,zb-h1"


@pytest.mark.parametrize(
    "pp, dp, schedules, order",
    [
        (1, 1, "gpipe,1f1b", "pipeline-inner"),
        (2, 1, ALL_SCHEDULES, "pipeline-inner"),
        (1, 2, "gpipe,1f1b", "pipeline-inner"),
        (2, 2, ALL_SCHEDULES, "pipeline-inner"),
        (4, 1, ALL_SCHEDULES, "pipeline-inner"),
        (3, 4, "gpipe,1f1b,zb-h1", "pipeline-inner"),
        (2, 2, "1f1b", "data-inner"),  # a stage's replicas on consecutive ranks
    ],
)
def test_hybrid_equals_serial(pp, dp, schedules, order):
    m = 2 * pp if pp > 1 else 3  # interleaved needs M % pp == 0
    proc = run_mpi(
        pp * dp,
        "tests/_mpi_train.py",
        "--serial",
        "--schedules",
        schedules,
        "--set",
        f"grid.order={order}",
        "--set",
        f"grid.pp={pp}",
        "--set",
        f"grid.dp={dp}",
        "--set",
        "train.steps=5",
        "--set",
        f"train.microbatches={m}",
        "--set",
        f"train.global_batch={dp * m * 4}",
        "--set",
        "model.depth=8",
        "--set",
        "model.hidden=32",
        "--set",
        "comm.codec=fp32",
        "--set",
        "comm.bucket_kb=1",  # a bucket per layer or two: rings start during the backward
        timeout=240,
    )
    runs = results(proc)
    assert [r["schedule"] for r in runs] == schedules.split(",")
    for r in runs:
        print(r["schedule"], "max |hybrid - serial| =", r["max_abs_diff"])
        assert r["allclose"], r
        assert np.allclose(r["losses"], r["serial_losses"], rtol=1e-5), r
        assert r["replica_max_diff"] == 0.0


def test_overlap_changes_timing_not_numbers():
    """Buckets reduced by a communication thread, by polling, or after the step: the same bits
    (losses, int8 bytes, replicas), whatever the schedule; many buckets and segments."""
    runs = {}
    for overlap in ("off", "thread", "poll"):
        proc = run_mpi(
            4,
            "tests/_mpi_train.py",
            "--schedules",
            "1f1b,zb-h1,interleaved-1f1b",
            *("--set", "grid.pp=2", "--set", "grid.dp=2", "--set", "train.steps=4"),
            *("--set", "train.microbatches=4", "--set", "train.global_batch=32"),
            *("--set", "model.depth=8", "--set", "model.hidden=48"),
            *("--set", "train.optimizer=adamw", "--set", "comm.codec=int8"),
            *("--set", "comm.bucket_kb=4", "--set", "comm.segment_kb=1"),
            "--set",
            f"comm.overlap={overlap}",
            timeout=180,
        )
        runs[overlap] = results(proc)
    for overlap in ("thread", "poll"):
        for base, other in zip(runs["off"], runs[overlap], strict=True):
            label = f"{other['schedule']} overlap={overlap}"
            print(label, "final loss", other["losses"][-1], "off:", base["losses"][-1])
            assert other["losses"] == base["losses"], label
            assert other["bytes_sent"] == base["bytes_sent"], label
            assert other["replica_max_diff"] == 0.0, label


def test_sync_sends_never_rely_on_eager_buffering():
    """Every schedule completes when each pipeline send is synchronous (Issend)."""
    proc = run_mpi(
        4,
        "tests/_mpi_train.py",
        "--schedules",
        ALL_SCHEDULES,
        "--set",
        "grid.pp=4",
        "--set",
        "grid.dp=1",
        "--set",
        "comm.sync_sends=true",
        "--set",
        "train.steps=2",
        "--set",
        "train.microbatches=8",
        "--set",
        "train.global_batch=64",
        "--set",
        "model.depth=8",
        timeout=180,
    )
    assert len(results(proc)) == 5


def test_seed_job_learns_and_int8_tracks_fp32():
    """The K=3 x D=4 seed job: >= 95% held-out, bit-identical replicas, int8 within 2% of fp32.
    fp32 is the serial run (rank 0 trains it after the job: the same math as the fp32 job to
    float summation order, in one process); a 4-step fp32 job gives the wire's fp32 bytes."""
    seed = ["--job", "jobs/seed_k3_d4.toml"]
    (int8,) = results(run_mpi(12, "tests/_mpi_train.py", *seed, "--serial", timeout=300))
    steps = 4
    fp32_job = ["--set", "comm.codec=fp32", "--set", f"train.steps={steps}"]
    (fp32,) = results(run_mpi(12, "tests/_mpi_train.py", *seed, *fp32_job, timeout=120))
    final_int8 = np.mean(int8["losses"][-10:])
    final_fp32 = np.mean(int8["serial_losses"][-10:])
    accuracy = int8["test_accuracy"]
    print(f"held-out {accuracy:.4f}; final loss int8 {final_int8:.5f}, fp32 {final_fp32:.5f}")
    assert int8["test_accuracy"] >= 0.95
    assert int8["replica_max_diff"] == 0.0
    assert abs(final_int8 - final_fp32) <= 0.02 * final_fp32 + 1e-3
    # int8 puts about a quarter of fp32's bytes on the wire (one fp32 scale per 256 values);
    # every step sends the same bytes
    ring = ("reduce_scatter", "all_gather")
    per_step_int8 = sum(int8["bytes_sent"][k] for k in ring) / len(int8["losses"])
    per_step_fp32 = sum(fp32["bytes_sent"][k] for k in ring) / steps
    ratio = per_step_int8 / per_step_fp32
    assert 0.24 < ratio < 0.27, ratio


def test_trace_holds_every_event_the_schedule_implies(tmp_path):
    from mpihybrid.trace.read import load
    from mpihybrid.trace.recorder import KIND

    path = tmp_path / "run.h5"
    steps, m, pp, dp = 3, 4, 2, 2
    proc = run_mpi(
        pp * dp,
        "-m",
        "mpihybrid",
        "train",
        "--quiet",
        "--trace",
        str(path),
        "--set",
        f"train.steps={steps}",
        "--set",
        f"train.microbatches={m}",
        "--set",
        "train.global_batch=32",
        "--set",
        "train.schedule=zb-h1",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    with h5py.File(path, "r") as f:
        assert "events" in f
    trace = load(path)
    ev = trace.events
    per_kind = steps * m * pp * dp
    for kind in ("forward", "backward", "weight"):
        assert np.sum(ev["kind"] == KIND[kind]) == per_kind, kind
    compute = ev[np.isin(ev["kind"], [KIND["forward"], KIND["backward"]])]
    # every (step, stage, replica, micro-batch) appears exactly once per kind
    keys = {
        (int(e["kind"]), int(e["step"]), int(e["stage"]), int(e["replica"]), int(e["microbatch"]))
        for e in compute
    }
    assert len(keys) == len(compute)
    sends = ev[(ev["kind"] == KIND["send"]) & (ev["microbatch"] >= 0)]
    assert len(sends) == 2 * steps * m * (pp - 1) * dp  # an activation and a gradient per boundary
    # peers are world ranks of the same pipeline (rank = dp_rank * pp + pp_rank)
    assert np.all(sends["peer"] // pp == sends["rank"] // pp)
    assert np.all(np.abs(sends["peer"] - sends["rank"]) == 1)
    assert np.sum(ev["kind"] == KIND["allreduce"]) == steps * pp * dp
    assert np.all(ev["end"] >= ev["start"])
    assert len(trace.steps["loss"]) == steps
    assert trace.attrs["world_size"] == pp * dp
    assert "as run" in proc.stdout and "bit-identical" in proc.stdout
