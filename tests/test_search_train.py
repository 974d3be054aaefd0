"""train.schedule = "auto" under mpiexec: == serial in fp32 with synchronous sends (MLP, GPT),
the same schedule from the same costs, resume bit for bit, another model's costs refused."""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

import numpy as np
import pytest

from mpihybrid.trace.read import load
from tests.helpers import results, run_mpi
from tests.test_schedules_train import TINY_GPT

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(
    "pp, dp, m, model, placements",
    [(2, 2, 4, "mlp", []), (3, 1, 6, "mlp", ["v"]), (4, 1, 8, "mlp", ["loop"]),
     (2, 1, 4, "gpt", ["v", "loop"])],
    ids=["2-2-4-mlp", "3-1-6-mlp", "4-1-8-mlp", "2-1-4-gpt"],  # tests/conftest.py names one
)  # fmt: skip
def test_auto_equals_serial(pp, dp, m, model, placements):
    """placements: train.schedule_placement of the run, then of each --also run (one launch)."""
    settings = [f"grid.pp={pp}", f"grid.dp={dp}", f"train.microbatches={m}",
                f"train.global_batch={dp * m * 2}", "train.steps=3", "comm.codec=fp32",
                "comm.sync_sends=true", "model.depth=8",
                # a deterministic second per search, not 4: these check the schedule runs as
                # serial, not how close the solve comes to proving it (tests/test_search.py)
                "train.schedule_time=1"]  # fmt: skip
    if model == "gpt":
        settings += [*TINY_GPT, "train.optimizer=adamw", "train.lr=1e-4"]
    else:
        settings += ["model.hidden=16"]
    settings += [f"train.schedule_placement={p}" for p in placements[:1]]
    argv = [arg for s in settings for arg in ("--set", s)]
    argv += [arg for p in placements[1:] for arg in ("--also", f"train.schedule_placement={p}")]
    proc = run_mpi(pp * dp, "tests/_mpi_train.py", "--serial", "--schedules", "auto", *argv,
                   timeout=300)  # fmt: skip
    runs = results(proc)
    assert len(runs) == max(1, len(placements))
    for r, placement in zip(runs, placements or [""], strict=True):
        assert r["allclose"] and r["max_abs_diff"] < 1e-5, r
        np.testing.assert_allclose(r["losses"], r["serial_losses"], rtol=1e-5)
        assert r["replica_max_diff"] == 0.0
        if placement:  # the placement forced is the one that ran: pp stages (loop) or 2 pp (V)
            assert len(r["peak_inflight"]) == pp * (2 if placement == "v" else 1), r


def test_auto_from_a_trace_resumes_bit_for_bit_and_refuses_another_model(tmp_path):
    base = ["--quiet", "--set", "grid.pp=2", "--set", "model.depth=8", "--set",
            "train.optimizer=adamw", "--set", "model.hidden=16", "--set",
            "train.schedule_time=1"]  # fmt: skip

    def train(steps, *extra, ok=True):
        proc = run_mpi(2, "-m", "mpihybrid", "train", *base, "--set", f"train.steps={steps}",
                       *extra, timeout=120)  # fmt: skip
        assert (proc.returncode == 0) == ok, proc.stderr[-3000:]
        return proc

    # on the job's timed blocks: 5 steps of the first search's schedule calibrate them (a
    # temporary trace, removed), then the search runs again; the trace is the run's 3 steps
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "mpihybrid-auto-*")))
    train(3, "--set", "train.schedule=auto", "--trace", str(tmp_path / "calibrated.h5"))
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "mpihybrid-auto-*"))) <= before
    calibrated = load(tmp_path / "calibrated.h5")
    info = json.loads(str(calibrated.attrs["schedule_search"]))
    assert info["calibration"]["steps"] == 5 and info["expected"]["steps"] == 3
    assert "calibrated on 5 steps" in info["costs"]["source"]
    assert sorted(set(calibrated.steps["step"].tolist())) == [0, 1, 2]
    costs = tmp_path / "costs.h5"
    train(3, "--set", "train.schedule=zb-v", "--trace", str(costs))
    # a schedule the second search changed runs its own steps, and they predict it
    from mpihybrid.cli.auto import expected_of_run
    from mpihybrid.config import build_job, resolve

    own = tmp_path / "own" / "run.h5"
    own.parent.mkdir()
    shutil.copy(costs, own)
    settings = [a for a in base if a.startswith(("grid", "model", "train"))]
    zbv = resolve(build_job({}, [*settings, "train.schedule=zb-v", "train.steps=3"]), 2)
    expected = expected_of_run(zbv, str(own), "a zb-v run")
    assert expected["steps"] == 1 and 0 < expected["bubble"] < 1 and expected["makespan"] > 0
    assert expected["on"] == "its own calibration run" and not own.parent.exists()
    auto = ["--set", "train.schedule=auto", "--set", f"train.schedule_costs={costs}"]
    train(6, *auto, "--trace", str(tmp_path / "whole.h5"))
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    train(3, *auto, "--set", ckpt, "--set", "checkpoint.every=3")
    train(6, *auto, "--resume", "--set", ckpt, "--trace", str(tmp_path / "resumed.h5"))
    whole, resumed = load(tmp_path / "whole.h5"), load(tmp_path / "resumed.h5")
    np.testing.assert_array_equal(resumed.steps["loss"], whole.steps["loss"])
    # the same costs gave the same schedule; the trace keeps it, its costs and the prediction
    assert whole.attrs["schedule_csv"] == resumed.attrs["schedule_csv"]
    assert str(whole.attrs["schedule"]).startswith("csv:auto@")
    assert '"costs"' in str(whole.attrs["schedule_search"])
    from mpihybrid.analysis.metrics import analyze

    assert analyze(whole)["run"]["search"]["makespan"] > 0  # analyze's "searched" line
    # costs of another model: one line, exit 2, before training
    proc = train(2, *auto, "--set", "model.hidden=24", ok=False)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1 and "another model: model.hidden" in lines[0], proc.stderr
