"""train.merge_w trained end to end under mpiexec: == serial in fp32 (MLP, GPT) with every W of
a stage merged, and a traced run whose rows, attributes and analysis say what was merged."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from mpihybrid.pipeline.plan import trace_schedule
from mpihybrid.trace.read import load
from mpihybrid.trace.recorder import KIND
from tests.helpers import results, run_mpi
from tests.test_schedules_train import TINY_GPT

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(
    "dp, merge, schedules, model",
    [
        (1, 4, "zb-h1,zb-v,dualpipev", "mlp"),
        (2, 3, "zb-h2,zb-v", "gpt"),
    ],
)
def test_merged_w_equals_serial(dp, merge, schedules, model):
    settings = ["grid.pp=2", f"grid.dp={dp}", "train.microbatches=4",
                f"train.global_batch={dp * 8}", "train.steps=3", "comm.codec=fp32",
                "comm.sync_sends=true", "model.depth=8", f"train.merge_w={merge}"]  # fmt: skip
    if model == "gpt":
        settings += [*TINY_GPT, "train.optimizer=adamw", "train.lr=1e-4"]
    else:
        settings += ["model.hidden=16"]
    argv = [arg for s in settings for arg in ("--set", s)]
    proc = run_mpi(2 * dp, "tests/_mpi_train.py", "--serial", "--schedules", schedules, *argv,
                   timeout=180)  # fmt: skip
    runs = results(proc)
    assert [r["schedule"] for r in runs] == schedules.split(",")
    for r in runs:
        # another order of the same sums (nn Linear.backward_weight_merged): float32 rounding
        print(f"{r['schedule']}: max |hybrid - serial| = {r['max_abs_diff']:.2e}")
        assert r["allclose"] and r["max_abs_diff"] < 1e-5, r
        np.testing.assert_allclose(r["losses"], r["serial_losses"], rtol=1e-5)
        assert r["replica_max_diff"] == 0.0


def test_a_merged_run_traces_a_row_per_microbatch_and_analyzes(tmp_path):
    trace = tmp_path / "merged.h5"
    proc = run_mpi(2, "-m", "mpihybrid", "train", "--quiet", "--trace", str(trace),
                   "--set", "train.schedule=zb-h1", "--set", "grid.pp=2", "--set", "grid.dp=1",
                   "--set", "train.microbatches=4", "--set", "train.global_batch=8",
                   "--set", "train.steps=4", "--set", "train.merge_w=4",
                   "--set", "model.depth=4", timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    t = load(trace)
    assert int(t.attrs["merge_w"]) == 4
    schedule = trace_schedule(t.attrs)
    assert [str(a) for a in schedule.compute[1] if a.kind == "W"] == ["1W0+1+2+3"]
    ev = t.events
    w = ev[(ev["kind"] == KIND["weight"]) & (ev["step"] == ev["step"].max())]
    for stage in (0, 1):
        rows = np.sort(w[w["stage"] == stage], order="start")
        # one row per micro-batch, back to back: the one pass's time split evenly
        assert rows["microbatch"].tolist() == [0, 1, 2, 3]
        np.testing.assert_allclose(rows["start"][1:], rows["end"][:-1])
        np.testing.assert_allclose(np.diff(rows["end"] - rows["start"]), 0.0, atol=1e-9)
    for command in (["analyze", str(trace)], ["whatif", str(trace), "--set", "M=8"]):
        proc = _cli(*command)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if command[0] == "analyze":  # its run line says how the W passes ran
            run = next(line for line in proc.stdout.splitlines() if line.startswith("== "))
            assert ", W merged in 4s," in run
    # whatif's merged W: costed by the trace's row probe, a fraction of a W per micro-batch
    proc = _cli("whatif", str(trace), "--set", "merge_w=2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["change"] == "merge_w=2" and len(doc["merge_ratios"]) == 2
    assert all(0 < r <= 1 for r in doc["merge_ratios"]) and doc["predicted"]["step"] > 0
    proc = _cli("whatif", str(trace), "--set", "merge_w=0")
    assert proc.returncode == 2 and "merge_w must be a whole number" in proc.stderr


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpihybrid", *argv], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
