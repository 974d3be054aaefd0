"""train.grad_clip: the global norm over every stage equals the serial run's, the clipped run
equals the serial clipped run under every schedule (V placements included), and the replicas
stay bit-identical under a lossy codec and the sharded optimizer. Every launch runs each case
untied and with model.tie_embeddings (tests/test_tie.py: the tie's own tests)."""

from __future__ import annotations

import pytest

from mpihybrid.config import ConfigError, load_job
from mpihybrid.nn.optim import clip_coefficient
from mpihybrid.pipeline.schedules import SCHEDULES
from tests.helpers import results, run_mpi

TINY_GPT = ["model.kind=gpt", "model.hidden=16", "model.heads=2", "model.ffn=32",
            "model.depth=4", "data.vocab=37", "data.seq_len=8", "data.test_samples=4",
            "data.kind=markov", "train.steps=3", "comm.codec=fp32"]  # fmt: skip


def test_clip_coefficient_is_torchs():
    assert clip_coefficient(2.0, 1.0) == pytest.approx(1.0 / (2.0 + 1e-6))
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(100.0, 0.0) == 1.0  # off


@pytest.mark.parametrize(
    "value, says",
    [("-1.0", "train.grad_clip = -1.0: must be >= 0"), ("nan", "train.grad_clip = nan: must be")],
)
def test_bad_clip_is_one_config_error(value, says):
    with pytest.raises(ConfigError) as err:
        load_job(None, [f"train.grad_clip={value}"], 2)
    assert says in str(err.value)


def _argv(settings):
    return [arg for s in settings for arg in ("--set", s)]


TIED = "model.tie_embeddings=true"


def _check(runs, names, clipped=True):
    assert [(r["schedule"], r["also"]) for r in runs] == [(n, a) for a in ("", TIED) for n in names]
    for r in runs:
        print(f"{r['schedule']} {r['also']}: norms {r['norms']} serial {r['serial_norms']}, "
              f"max |hybrid - serial| = {r['max_abs_diff']:.2e}")  # fmt: skip
        assert r["norms"] == pytest.approx(r["serial_norms"], rel=1e-5)
        assert r["max_abs_diff"] < 1e-5, r
        assert r["replica_max_diff"] == 0.0
        if clipped:  # the clip bites on every step: a wrong norm would move the weights
            assert min(r["norms"]) > 0.05


@pytest.mark.mpi
@pytest.mark.parametrize("pp", [2, 3])
def test_clipped_run_equals_serial_under_every_schedule(pp):
    m = 2 * pp
    settings = [*TINY_GPT, f"grid.pp={pp}", "grid.dp=1", "train.optimizer=sgd", "train.lr=0.1",
                "train.grad_clip=0.05", f"train.microbatches={m}",
                f"train.global_batch={2 * m}"]  # fmt: skip
    names = [n for n in SCHEDULES if n != "naive"]
    proc = run_mpi(pp, "tests/_mpi_train.py", "--serial", "--schedules", ",".join(names),
                   "--also", TIED, *_argv(settings), timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    _check(results(proc), names)


@pytest.mark.mpi
def test_replicas_identical_when_clipping_with_int8_and_sharded_optimizer():
    settings = [*TINY_GPT, "grid.pp=2", "grid.dp=2", "train.optimizer=adamw", "train.lr=1e-3",
                "train.grad_clip=0.05", "train.microbatches=4", "train.global_batch=16",
                "train.shard_optimizer=true", "comm.param_codec=bf16",
                "comm.codec=int8", "comm.bucket_kb=1"]  # fmt: skip
    proc = run_mpi(4, "tests/_mpi_train.py", "--schedules", "1f1b,zb-v", "--also", TIED,
                   *_argv(settings), timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = results(proc)
    assert len(runs) == 4
    for r in runs:
        assert r["replica_max_diff"] == 0.0, r
    fp32 = [s for s in settings if not s.startswith(("comm.codec", "comm.param_codec"))]
    proc = run_mpi(4, "tests/_mpi_train.py", "--serial", "--schedules", "1f1b,zb-v",
                   "--also", TIED, *_argv(fp32), timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = results(proc)
    assert len(runs) == 4
    for r in runs:  # the sharded optimizer (tied too: the table's owned chunks) == serial
        print(f"sharded {r['schedule']} {r['also']}: max |hybrid - serial| = "
              f"{r['max_abs_diff']:.2e}")  # fmt: skip
        assert r["norms"] == pytest.approx(r["serial_norms"], rel=1e-5)
        assert r["max_abs_diff"] < 1e-5, r
        assert r["replica_max_diff"] == 0.0


def test_the_norm_is_the_buckets_sums_of_squares_and_names_a_stage_not_finite():
    """Each held bucket's sum of squares is taken as its ring ends (here one rank: the ring is
    the identity); the norm adds them up, and a nan in one stage's gradient names that stage
    (the step's end reads it instead of a pass of its own over the gradient)."""
    import math

    import numpy as np
    from mpi4py import MPI

    from mpihybrid.comm.buckets import GradientComm
    from mpihybrid.comm.settings import GradientSettings
    from mpihybrid.train.clip import global_norm

    rng = np.random.default_rng(0)
    grads = {0: rng.standard_normal(40).astype(np.float32), 1: np.full(9, 2.0, np.float32)}
    layers = {0: [(0, 10), (10, 25), (25, 40)], 1: [(0, 9)]}
    comm = GradientComm(MPI.COMM_SELF, GradientSettings(bucket_bytes=40))
    reducers = {s: comm.reducer(s, grads[s], layers[s]) for s in grads}
    try:
        for poison in (False, True):
            if poison:
                grads[1][4] = np.nan
            for red in reducers.values():
                red.hold = True
                red.begin_step()
            comm.finish()
            norm, bad = global_norm(MPI.COMM_SELF, reducers)
            if poison:
                assert math.isnan(norm) and bad == [1]
            else:
                assert len(reducers[0].sumsq) == 3
                expected = math.sqrt(sum(float(np.dot(g, g)) for g in grads.values()))
                assert norm == pytest.approx(expected, rel=1e-6) and bad == []
    finally:
        comm.close()


def test_analyze_reports_the_norms():
    from types import SimpleNamespace

    from mpihybrid.analysis.metrics import _quality
    from mpihybrid.analysis.report import grad_norm_lines

    trace = SimpleNamespace(steps={"loss": [3.0, 2.0, 1.0], "grad_norm": [4.0, 9.0, 2.0]},
                            attrs={}, evals={})  # fmt: skip
    q = _quality(trace)
    assert q["grad_norm"] == {"last": 2.0, "median": 4.0, "max": 9.0, "max_step": 2}
    assert grad_norm_lines(q["grad_norm"]) == ["gradient norm   last 2, median 4, max 9 (step 2)"]
    assert _quality(SimpleNamespace(steps={"loss": [1.0]}, attrs={}, evals={}))["grad_norm"] is None
