"""Optimizers: sliced updates equal one whole-buffer update bit for bit; AdamW is Adam-W.

python -m pytest tests/test_optim.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from mpihybrid.nn.optim import SGD, AdamW

N = 200_003  # several of AdamW's 64K blocks, not a multiple of one

OPTIMIZERS = {
    "sgd": lambda p: SGD(p, lr=0.1),
    "sgd-momentum-decay": lambda p: SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda p: AdamW(p, lr=1e-3),
    "adamw-decay": lambda p: AdamW(p, lr=1e-3, weight_decay=0.1),
}


def _grads(steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal(N).astype(np.float32) for _ in range(steps)]


def _cover(rng: np.random.Generator) -> list[tuple[int, int]]:
    """Random slices covering [0, N) once, shuffled; one of them empty."""
    cuts = np.sort(rng.choice(np.arange(1, N), size=9, replace=False))
    bounds = [0, *cuts.tolist(), N]
    slices = [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)] + [(5, 5)]
    return [slices[i] for i in rng.permutation(len(slices))]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sliced_updates_equal_whole_step_bit_for_bit(name):
    make = OPTIMIZERS[name]
    init = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    whole, sliced = init.copy(), init.copy()
    opt_whole, opt_sliced = make(whole), make(sliced)
    rng = np.random.default_rng(2)
    for g in _grads(3):
        opt_whole.step(g)
        opt_sliced.begin_step()
        for lo, hi in _cover(rng):
            opt_sliced.update(g, lo, hi)
    assert not np.array_equal(whole, init)
    np.testing.assert_array_equal(sliced, whole)
    for key, state in opt_whole.state().items():
        np.testing.assert_array_equal(opt_sliced.state()[key], state)
    assert opt_whole.step_count == opt_sliced.step_count == 3


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_scaled_update_equals_scaling_the_gradient_first(name):
    """scale_gradients(coef) (train.grad_clip's coefficient, folded into the update's own
    pass) gives the bits of g *= float32(coef) before the update; the next step reads g as is."""
    make = OPTIMIZERS[name]
    init = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    folded, scaled = init.copy(), init.copy()
    opt_folded, opt_scaled = make(folded), make(scaled)
    rng = np.random.default_rng(3)
    for coef, g in zip([0.37, 1.0, 0.05], _grads(3), strict=True):
        opt_folded.begin_step()
        opt_folded.scale_gradients(coef)
        for lo, hi in _cover(rng):
            opt_folded.update(g.copy(), lo, hi)
        opt_scaled.step(g * np.float32(coef))
    assert not np.array_equal(folded, init)
    np.testing.assert_array_equal(folded, scaled)
    for key, state in opt_scaled.state().items():
        np.testing.assert_array_equal(opt_folded.state()[key], state)
    opt_folded.begin_step()  # a new step reads its gradient unscaled until told otherwise
    assert opt_folded.g_scale == 1


def test_adamw_matches_the_textbook_update():
    """Three AdamW steps against the formula in float64 (fp32 rounding: rtol 1e-5)."""
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.1
    p = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    ref, m, v = p.astype(np.float64), np.zeros(N), np.zeros(N)
    opt = AdamW(p, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for t, g in enumerate(_grads(3), start=1):
        opt.step(g)
        ref *= 1 - lr * wd
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g.astype(np.float64) ** 2
        ref -= lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    diff = np.abs(p - ref).max()
    print(f"AdamW vs float64 formula: max abs diff {diff:.2e}")
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-6)
