"""model.tie_embeddings: the head's weight is the token table, on one stage or across ranks
(the two copies' gradients summed every step), equal to the serial tied model."""

from __future__ import annotations

import numpy as np
import pytest

from mpihybrid.config import ConfigError, load_job
from mpihybrid.nn.model import build_stage
from tests.helpers import results, run_mpi
from tests.serial_reference import train_serial

TINY_GPT = ["model.kind=gpt", "model.hidden=16", "model.heads=2", "model.ffn=32",
            "model.depth=4", "data.vocab=37", "data.seq_len=8", "data.test_samples=4",
            "data.kind=markov", "train.steps=3", "comm.codec=fp32",
            "model.tie_embeddings=true"]  # fmt: skip


def test_serial_tied_model_keeps_head_equal_to_the_table():
    job = load_job(None, [*TINY_GPT, "grid.pp=1", "train.optimizer=adamw", "train.lr=1e-2",
                          "train.global_batch=8", "train.microbatches=2"], 1)  # fmt: skip
    flat, losses = train_serial(job)
    d = job.data
    stage = build_stage(job.model, d.seq_len, d.vocab, 0, 1, 0)
    stage.flat_params[...] = flat
    table, head = stage.blocks[0][0].params["tokens"], stage.blocks[-1][1].params["weight"]
    np.testing.assert_array_equal(head, table.T)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "settings, says",
    [(["model.kind=mlp", "data.kind=teacher"], "model.tie_embeddings: a gpt's"),
     (["train.shard_optimizer=true", "grid.dp=2", "grid.pp=1"], "without train.shard_optimizer")],
)  # fmt: skip
def test_bad_tying_is_one_config_error(settings, says):
    with pytest.raises(ConfigError, match=says):
        load_job(None, [*TINY_GPT, *settings], 2)


@pytest.mark.mpi
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_tied_run_equals_serial_under_every_schedule(pp):
    """Across ranks (1F1B, ZB-H1, interleaved: the embedding and the head on two ranks) and
    on one (the V schedules: rank 0 holds both), clipped too."""
    m = 2 * pp
    settings = [*TINY_GPT, f"grid.pp={pp}", "grid.dp=1", "train.optimizer=sgd", "train.lr=0.1",
                "train.grad_clip=0.05", f"train.microbatches={m}",
                f"train.global_batch={2 * m}"]  # fmt: skip
    names = ["1f1b"] if pp == 1 else ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "v-half"]
    argv = [arg for s in settings for arg in ("--set", s)]
    proc = run_mpi(pp, "tests/_mpi_train.py", "--serial", "--schedules", ",".join(names), *argv,
                   timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = results(proc)
    assert [r["schedule"] for r in runs] == names
    for r in runs:
        print(f"{r['schedule']}: max |hybrid - serial| = {r['max_abs_diff']:.2e}")
        assert r["max_abs_diff"] < 1e-5, r
        assert r["norms"] == pytest.approx(r["serial_norms"], rel=1e-5)
