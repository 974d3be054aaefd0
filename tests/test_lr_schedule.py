"""train.lr_schedule: nanoGPT's warmup + cosine/linear decay, its validation, the optimizers
taking the rate of each step, and a resumed run continuing the schedule exactly."""

from __future__ import annotations

import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from mpihybrid.config import ConfigError, load_job
from mpihybrid.nn.optim import AdamW, learning_rate
from mpihybrid.trace.read import load
from tests.helpers import run_mpi


def cfg(schedule="cosine", lr=1e-3, min_lr=1e-4, warmup=10, steps=100):
    return SimpleNamespace(lr_schedule=schedule, lr=lr, min_lr=min_lr, warmup_steps=warmup,
                           steps=steps, lr_decay_steps=0)  # fmt: skip


def nanogpt_get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """nanoGPT's train.py get_lr, written out again as the reference."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def test_cosine_is_nanogpts_get_lr():
    c = cfg()
    for step in range(0, 120):
        assert learning_rate(c, step) == pytest.approx(
            nanogpt_get_lr(step, 1e-3, 1e-4, 10, 100), rel=1e-12, abs=0
        )
    assert learning_rate(c, 9) == pytest.approx(1e-3 * 10 / 11)
    assert learning_rate(c, 10) == 1e-3  # the peak right after the warmup
    assert learning_rate(c, 55) == pytest.approx(0.5 * (1e-3 + 1e-4))  # half way down
    assert 1e-4 < learning_rate(c, 99) < 1.003e-4  # one step above min_lr at the end


def test_linear_and_constant():
    c = cfg("linear", warmup=0)
    assert learning_rate(c, 0) == 1e-3
    assert learning_rate(c, 50) == pytest.approx(0.5 * (1e-3 + 1e-4))
    assert learning_rate(c, 100) == 1e-4
    const = cfg("constant", warmup=4)
    assert [learning_rate(const, s) for s in (0, 3, 4, 99)] == pytest.approx(
        [1e-3 / 5, 4e-3 / 5, 1e-3, 1e-3]
    )
    assert learning_rate(cfg("constant", warmup=0), 0) == 1e-3  # today's rate, unchanged


def test_adamw_takes_the_rate_of_each_step():
    """begin_step(lr) at a rate is the optimizer built at that rate (the same bits)."""
    rng = np.random.default_rng(0)
    p0, g = rng.standard_normal(1000, np.float32), rng.standard_normal(1000, np.float32)
    a, b = p0.copy(), p0.copy()
    scheduled, fixed = AdamW(a, 1.0, weight_decay=0.1), AdamW(b, 3e-3, weight_decay=0.1)
    scheduled.step(g, 3e-3)
    fixed.step(g)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "setting, says",
    [
        (["train.min_lr=0.1"], "train.min_lr = 0.1: must be in [0, train.lr = 0.01]"),
        (["train.min_lr=-1e-3"], "train.min_lr = -0.001"),
        (["train.warmup_steps=31"], "train.warmup_steps = 31: must be in [0, train.steps = 30]"),
        (["train.warmup_steps=-1"], "train.warmup_steps = -1"),
        (["train.lr_schedule=step"], "train.lr_schedule = 'step': unknown"),
        (["train.min_lr=nan"], "train.min_lr = nan: must be a finite number"),
        (["train.lr_decay_steps=-2"], "train.lr_decay_steps = -2"),
        (
            ["train.lr_decay_steps=5", "train.warmup_steps=5"],
            "train.lr_decay_steps = 5: must be 0 (= train.steps) or more than train.warmup_steps",
        ),
    ],
)
def test_bad_schedule_is_one_config_error(setting, says):
    with pytest.raises(ConfigError) as err:
        load_job(None, setting, 2)
    assert says in str(err.value) and "\n" not in str(err.value)


class _OneRank:
    rank = 0

    def bcast(self, value, root=0):
        return value


def test_a_resume_with_other_steps_keeps_the_horizon(monkeypatch):
    """A decaying rate resumed with more (or fewer) train.steps keeps the step its decay ends at
    (the uninterrupted run's rates, min_lr past it), unless train.lr_decay_steps is given."""
    from mpihybrid.train import resume

    base = ["train.lr_schedule=cosine", "train.warmup_steps=2", "train.lr=1e-3",
            "train.min_lr=1e-4"]  # fmt: skip
    ten = load_job(None, [*base, "train.steps=10"], 2)
    job = load_job(None, [*base, "train.steps=20"], 2)
    monkeypatch.setattr(resume, "_recorded", lambda job, key, default_key=None: 10)
    kept = resume.keep_recorded_horizon(job, _OneRank(), given=False)
    assert kept.train.lr_decay_steps == 10 and kept.train.steps == 20
    assert [learning_rate(kept.train, s) for s in range(10)] == [
        learning_rate(ten.train, s) for s in range(10)
    ]
    assert learning_rate(kept.train, 15) == 1e-4
    assert resume.keep_recorded_horizon(job, _OneRank(), given=True) is job
    constant = load_job(None, ["train.steps=20"], 2)
    assert resume.keep_recorded_horizon(constant, _OneRank(), given=False) is constant
    monkeypatch.setattr(resume, "_recorded", lambda job, key, default_key=None: 20)
    assert resume.keep_recorded_horizon(job, _OneRank(), given=False) is job


def test_warmup_as_long_as_the_run_is_allowed():
    job = load_job(None, ["train.warmup_steps=30", "train.lr_schedule=cosine"], 2)
    assert learning_rate(job.train, 29) == pytest.approx(job.train.lr * 30 / 31)


@pytest.mark.mpi
def test_resume_continues_the_schedule_exactly(tmp_path):
    """The same job run through, and resumed from its step-4 checkpoint: the same losses, bit for
    bit, and /steps/lr is the schedule's rate of every step."""
    ckpt, whole, resumed = tmp_path / "ckpt", tmp_path / "whole.h5", tmp_path / "resumed.h5"
    args = ["-m", "mpihybrid", "train", "--quiet", "--set", "train.steps=10",
            "--set", "train.optimizer=adamw", "--set", "train.lr=3e-3",
            "--set", "train.lr_schedule=cosine", "--set", "train.warmup_steps=3",
            "--set", "train.min_lr=3e-4", "--set", f"checkpoint.dir={ckpt}",
            "--set", "checkpoint.every=4", "--set", "checkpoint.keep=3"]  # fmt: skip
    proc = run_mpi(2, *args, "--trace", str(whole))
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(ckpt / "step-000008")
    proc = run_mpi(2, *args, "--resume", "--trace", str(resumed))
    assert proc.returncode == 0, proc.stderr
    a, b = load(whole), load(resumed)
    np.testing.assert_array_equal(a.steps["loss"], b.steps["loss"])
    job = load_job(None, [a for a in args[5:] if a != "--set"], 2)
    rates = [learning_rate(job.train, s) for s in range(10)]
    np.testing.assert_array_equal(a.steps["lr"], rates)
    np.testing.assert_array_equal(b.steps["lr"], rates)
    # resumed with more steps: the schedule keeps its horizon (step 10), then min_lr
    longer = tmp_path / "longer.h5"
    proc = run_mpi(2, *args, "--set", "train.steps=12", "--resume", "--trace", str(longer))
    assert proc.returncode == 0, proc.stderr
    assert "decays to train.min_lr at step 10, as in the run this resumes" in proc.stdout
    np.testing.assert_array_equal(load(longer).steps["lr"], [*rates, 3e-4, 3e-4])
