"""The schedules beyond ZB-H1 trained end to end under mpiexec: == serial in fp32 (MLP, GPT),
bit-identical replicas under int8, zb-v resumed from a checkpoint bit for bit, a torch-made CSV.

One mpiexec launch runs every schedule of a case (tests/_mpi_train.py --schedules), with
synchronous sends: completing proves no reliance on MPI's eager buffering.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpihybrid.trace.read import load
from tests.helpers import ROOT, results, run_mpi

pytestmark = pytest.mark.mpi

TORCH_ZBV = f"csv:{ROOT / 'tests' / 'data' / 'torch_zbv_pp2_m4.csv'}"
NEW = "zb-h2,zb-v,dualpipev,v-half"
TINY_GPT = ["model.kind=gpt", "model.hidden=16", "model.heads=2", "model.ffn=32", "data.vocab=37",
            "data.seq_len=8", "data.test_samples=4", "data.kind=markov"]  # fmt: skip


def _run(n: int, schedules: str, settings: list[str], timeout: float = 120) -> list[dict]:
    argv = [arg for s in settings for arg in ("--set", s)]
    proc = run_mpi(n, "tests/_mpi_train.py", "--serial", "--schedules", schedules, *argv,
                   timeout=timeout)  # fmt: skip
    runs = results(proc)
    assert [r["schedule"] for r in runs] == schedules.split(",")
    return runs


@pytest.mark.parametrize(
    "pp, dp, m, schedules, model",
    [
        # dualpipev's fewest micro-batches (2p); zb-v below 2p-1 (torch's padding) at pp=3
        (2, 2, 4, f"{NEW},{TORCH_ZBV}", "mlp"),
        (3, 1, 6, NEW, "mlp"),
        (3, 1, 3, "zb-h2,zb-v,v-half", "mlp"),
        (4, 1, 8, NEW, "mlp"),
        (2, 1, 6, NEW, "gpt"),
        (2, 2, 4, "zb-v,dualpipev", "gpt"),
    ],
)
def test_new_schedules_equal_serial(pp, dp, m, schedules, model):
    settings = [f"grid.pp={pp}", f"grid.dp={dp}", f"train.microbatches={m}",
                f"train.global_batch={dp * m * 2}", "train.steps=3", "comm.codec=fp32",
                "comm.sync_sends=true", "model.depth=8"]  # fmt: skip
    if model == "gpt":
        settings += [*TINY_GPT, "train.optimizer=adamw", "train.lr=1e-4"]
    else:
        settings += ["model.hidden=16"]
    for r in _run(pp * dp, schedules, settings):
        print(f"{r['schedule']}: max |hybrid - serial| = {r['max_abs_diff']:.2e}")
        assert r["allclose"] and r["max_abs_diff"] < 1e-5, r
        np.testing.assert_allclose(r["losses"], r["serial_losses"], rtol=1e-5)
        assert r["replica_max_diff"] == 0.0


def test_int8_replicas_stay_bit_identical():
    settings = ["grid.pp=2", "grid.dp=2", "train.microbatches=4", "train.global_batch=16",
                "train.steps=3", "comm.codec=int8", "model.depth=8", "model.hidden=16"]  # fmt: skip
    argv = [arg for s in settings for arg in ("--set", s)]
    proc = run_mpi(4, "tests/_mpi_train.py", "--schedules", NEW, *argv, timeout=120)
    for r in results(proc):
        assert r["replica_max_diff"] == 0.0, r


def test_zb_v_resume_is_bit_identical(tmp_path):
    base = ["--quiet", "--set", "train.schedule=zb-v", "--set", "grid.pp=2", "--set",
            "model.depth=8", "--set", "train.optimizer=adamw"]  # fmt: skip

    def train(steps, *extra):
        proc = run_mpi(2, "-m", "mpihybrid", "train", *base, "--set", f"train.steps={steps}",
                       *extra, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    train(6, "--trace", str(tmp_path / "whole.h5"))
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    train(3, "--set", ckpt, "--set", "checkpoint.every=3")
    train(6, "--resume", "--set", ckpt, "--trace", str(tmp_path / "resumed.h5"))
    whole, resumed = load(tmp_path / "whole.h5"), load(tmp_path / "resumed.h5")
    np.testing.assert_array_equal(resumed.steps["loss"], whole.steps["loss"])
    assert list(whole.attrs["stage_ranks"]) == [0, 1, 1, 0]  # the V, in the trace
