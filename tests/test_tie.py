"""model.tie_embeddings: the head's weight is the token table, one parameter where one rank holds
both, a mirror with the gradients summed where two do; held once in checkpoints and the memory
model. The == serial cases under every schedule at pp 2 and 3, the replicas and the sharded
optimizer run in tests/test_clip.py's launches (each case tied and untied)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpihybrid.config import ConfigError, load_job
from mpihybrid.nn.model import build_stage, stage_num_params
from mpihybrid.trace.read import load
from mpihybrid.train.tie import bind_local, held_nbytes
from tests.helpers import mpi_env, run_mpi
from tests.serial_reference import train_serial

TINY_GPT = ["model.kind=gpt", "model.hidden=16", "model.heads=2", "model.ffn=32",
            "model.depth=4", "data.vocab=37", "data.seq_len=8", "data.test_samples=4",
            "data.kind=markov", "train.steps=3", "comm.codec=fp32",
            "model.tie_embeddings=true"]  # fmt: skip
V, C = 37, 16


def _job(*settings, world=1):
    return load_job(None, [*TINY_GPT, *settings], world)


def test_one_rank_holds_the_table_once():
    """pp = 1: the head's weight and gradient are views of the table's; the stage holds V x C
    fewer parameters than the untied model, and the serial tied model trains."""
    job = _job("grid.pp=1", "train.optimizer=adamw", "train.lr=1e-2", "train.global_batch=8",
               "train.microbatches=2")  # fmt: skip
    untied = load_job(None, [*TINY_GPT[:-1], "grid.pp=1"], 1)
    stage = build_stage(job.model, 8, V, 0, 1, seed=0)
    assert stage.num_params == build_stage(untied.model, 8, V, 0, 1, seed=0).num_params - V * C
    assert bind_local([stage], job.model)
    table, head = stage.layers[0], stage.layers[-1]
    assert np.shares_memory(head.params["weight"], table.params["tokens"])
    assert np.shares_memory(head.grads["weight"], table.grads["tokens"])
    np.testing.assert_array_equal(head.params["weight"], table.params["tokens"].T)
    flat, losses = train_serial(job)
    assert flat.size == stage.num_params
    assert losses[-1] < losses[0]


def test_a_head_alone_has_a_weight_of_its_own_until_tied():
    """The last chunk built alone (profiles, the memory check's warm-up) computes with zeros."""
    job = _job("grid.pp=2", world=2)
    head_stage = build_stage(job.model, 8, V, 1, 2, seed=0)
    assert head_stage.layers[-1].params["weight"].shape == (C, V)
    assert not bind_local([head_stage], job.model)
    y, _ = head_stage.forward(np.ones((2, 8, C), np.float32))
    assert y.shape == (2, 8, V)


def test_memory_counts_what_each_rank_holds():
    assert held_nbytes(True, True, V, C) == 0  # one rank: views
    assert held_nbytes(False, True, V, C) == 2 * 4 * V * C  # the mirror and its gradient
    assert held_nbytes(True, False, V, C) == 4 * V * C  # the head's gradient as it arrives
    assert held_nbytes(False, False, V, C) == 0


def test_a_split_vocabulary_counts_no_mirror():
    """model.vocab_parallel: each share holds one matrix and training makes no embedding group,
    so the memory model counts no mirror and predict no tie messages (they did: 2368 and 4736
    bytes on the two ranks of this job)."""
    from mpihybrid.predict.cluster import find_cluster, load_cluster
    from mpihybrid.predict.wire import tie_seconds
    from mpihybrid.train.memory import rank_estimate

    tied = _job("grid.pp=2", world=2)
    split = _job("grid.pp=2", "model.vocab_parallel=true", world=2)
    assert [rank_estimate(tied, r)["tied embedding"] for r in range(2)] == [4 * V * C, 8 * V * C]
    assert [rank_estimate(split, r)["tied embedding"] for r in range(2)] == [0, 0]
    cluster = load_cluster(find_cluster("local"))
    assert tie_seconds(tied, cluster) > 0 and tie_seconds(split, cluster) == 0


@pytest.mark.parametrize(
    "settings, says",
    [
        (
            ["model.kind=mlp", "data.kind=teacher", "model.heads=4", "model.ffn=0"],
            r"model.tie_embeddings = true: a gpt's or a llama's setting \(model.kind = 'mlp'",
        ),
        (["model.kind=mlp", "data.kind=teacher"], "model.heads = 2: a gpt's or a llama's"),
    ],
)
def test_bad_tying_is_one_config_error(settings, says):
    with pytest.raises(ConfigError, match=says):
        load_job(None, [*TINY_GPT, *settings], 2)


def test_the_sharded_optimizer_takes_a_tied_model():
    job = _job("train.shard_optimizer=true", "grid.dp=2", "grid.pp=1", world=2)
    assert job.model.tie_embeddings and job.train.shard_optimizer


@pytest.mark.mpi
def test_tied_checkpoint_holds_the_table_once_and_resumes(tmp_path):
    """interleaved 1F1B (pp = 2, v = 2: the table on rank 0, the head on rank 1, a mirror)
    through 6 steps, and resumed from its step-3 checkpoint: the same losses, bit for bit; the
    same checkpoint resumed under zb-v (rank 0 holds both: one parameter) to float order."""
    ckpt = tmp_path / "ckpt"
    settings = [*TINY_GPT[:-3], "model.tie_embeddings=true", "comm.codec=fp32", "train.steps=6",
                "grid.pp=2", "train.optimizer=adamw", "train.lr=3e-3", "train.microbatches=4",
                "train.global_batch=8", "train.virtual_stages=2", "train.grad_clip=0.5",
                f"checkpoint.dir={ckpt}", "checkpoint.every=3", "checkpoint.keep=3"]  # fmt: skip
    args = ["-m", "mpihybrid", "train", "--quiet", *[a for s in settings for a in ("--set", s)]]
    traces = {}
    for name, schedule, extra in [("whole", "interleaved-1f1b", []),
                                  ("same", "interleaved-1f1b", ["--resume"]),
                                  ("zb-v", "zb-v", ["--resume"])]:  # fmt: skip
        if extra:
            shutil.rmtree(ckpt / "step-000006", ignore_errors=True)
        traces[name] = tmp_path / f"{name}.h5"
        proc = run_mpi(2, *args, "--set", f"train.schedule={schedule}", *extra,
                       "--trace", str(traces[name]))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        if name == "whole":  # the head's chunk keeps no copy of the table
            job = _job("grid.pp=2", "train.virtual_stages=2", "train.schedule=interleaved-1f1b",
                       world=2)  # fmt: skip
            sizes = stage_num_params(job.model, 8, V, 4)
            for s, n in enumerate(sizes):
                with h5py.File(ckpt / "step-000003" / f"stage-{s:03d}.h5") as f:
                    assert f["params"].shape == (n,)
            assert sum(sizes) == build_stage(job.model, 8, V, 0, 1, seed=0).num_params
    gen = [sys.executable, "-m", "mpihybrid", "generate", str(ckpt), "--tokens", "5", "--ids",
           "--prompt", "3 4"]  # fmt: skip
    sample = subprocess.run(gen, capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert sample.returncode == 0, sample.stderr  # generate builds every stage, the head tied
    assert len(sample.stdout.split()) == 5
    whole, same, zbv = (load(traces[k]).steps["loss"] for k in ("whole", "same", "zb-v"))
    np.testing.assert_array_equal(same, whole)  # a resumed trace holds the earlier steps too
    np.testing.assert_allclose(zbv, whole, rtol=1e-5)
