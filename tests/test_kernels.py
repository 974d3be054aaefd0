"""The fused numba kernels against their numpy references, at the tolerances kernels.py states.

    python -m pytest tests/test_kernels.py -q -s     # -s prints each op's max difference

Each test runs a layer (or the optimizer) twice on the same float32 inputs: once with the
kernels, once with `_numba.ENABLED` off (the numpy reference), and compares.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpihybrid import _numba
from mpihybrid.nn import kernels
from mpihybrid.nn.layers import GELU, LayerNorm, SoftmaxCrossEntropy
from mpihybrid.nn.optim import AdamW
from mpihybrid.nn.transformer import CausalAttention

pytestmark = pytest.mark.skipif(not _numba.ENABLED, reason="numba kernels not enabled")

# b = sequences, T = tokens, C = width, F = feed-forward width
b, T, C, F, HEADS = 2, 16, 24, 40, 4


def both(run):
    """run() with the kernels, then with the numpy reference: (fast, reference)."""
    fast = run()
    _numba.ENABLED = False
    try:
        reference = run()
    finally:
        _numba.ENABLED = True
    return fast, reference


def assert_close(name: str, fast, reference, atol) -> None:
    """atol: one tolerance for every output, or one per output."""
    atols = atol if isinstance(atol, tuple) else (atol,) * len(fast)
    for i, (f, r, atol) in enumerate(zip(fast, reference, atols, strict=True)):
        assert f.dtype == np.float32 and f.shape == r.shape
        diff = float(np.abs(f - r).max())
        print(f"{name}[{i}]: max abs diff {diff:.2e} (atol {atol:.0e})")
        assert diff <= atol, f"{name}[{i}]: {diff} > {atol}"


def _rng() -> np.random.Generator:
    return np.random.default_rng(3)


def test_fast_path_only_for_float32_numpy():
    x = np.zeros((3, 4), np.float32)
    assert kernels.fast(x)
    assert not kernels.fast(x.astype(np.float64))
    assert not kernels.fast(x[:, ::2])  # not contiguous


def test_tanh_approximation_error():
    z = np.linspace(-12, 12, 200_001).astype(np.float32)
    y = np.empty_like(z)
    kernels.gelu_forward(z, y, y)  # t lands in y last: y = tanh(k (z + a z^3)), overwritten
    t = np.empty_like(z)
    kernels.gelu_forward(z, np.empty_like(z), t)
    u = np.sqrt(2 / np.pi) * (z.astype(np.float64) + 0.044715 * z.astype(np.float64) ** 3)
    diff = float(np.abs(t - np.tanh(u)).max())
    print(f"tanh: max abs error {diff:.2e}")
    assert diff < 5e-7


def test_gelu_forward_backward():
    x = (_rng().standard_normal((b, T, F)) * 3).astype(np.float32)
    dy = _rng().standard_normal(x.shape).astype(np.float32)

    def run():
        layer = GELU()
        y, cache = layer.forward(x)
        return y, layer.backward(dy, cache)

    # the backward multiplies tanh's error by dy x k (1 + 3 a x^2): up to 20 at |x| ~ 3
    assert_close("gelu", *both(run), atol=(1e-6, 1e-5))


def test_layernorm_forward_backward():
    rng = _rng()
    x = (rng.standard_normal((b, T, C)) * 2 + 0.5).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(C)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(C)).astype(np.float32)

    def run():
        layer = LayerNorm(C)
        grads = {"weight": np.full(C, 0.5, np.float32), "bias": np.full(C, -0.5, np.float32)}
        layer.bind({"weight": w, "bias": bias}, grads)
        y, cache = layer.forward(x)
        dx = layer.backward(dy, cache)  # weight gradients accumulate onto 0.5 / -0.5
        return y, dx, grads["weight"], grads["bias"]

    assert_close("layernorm", *both(run), atol=1e-5)


def test_causal_attention_forward_backward():
    rng = _rng()
    x = rng.standard_normal((b, T, 3 * C)).astype(np.float32)
    dy = rng.standard_normal((b, T, C)).astype(np.float32)

    def run():
        layer = CausalAttention(C, HEADS, T)
        y, cache = layer.forward(x)
        probs = cache[1].copy()  # backward reuses its buffers
        return y, probs, layer.backward(dy, cache)

    fast, reference = both(run)
    assert_close("attention", fast, reference, atol=1e-6)
    assert np.all(np.triu(fast[1], k=1) == 0)  # nothing above the diagonal


def test_cross_entropy_forward_backward():
    rng = _rng()
    logits = (rng.standard_normal((b, T, 1000)) * 4).astype(np.float32)
    logits[0, 0, :] = -200.0  # a flat row, and one far below the rest: exp's clamp at -87
    logits[0, 0, 3] = 50.0
    targets = rng.integers(0, 1000, (b, T))

    def run():
        loss_fn = SoftmaxCrossEntropy()
        loss, cache = loss_fn.forward(logits.copy(), targets)
        exps = cache[0].copy()
        correct = loss_fn.correct(cache)
        return loss, exps, correct, loss_fn.backward(cache, 0.5)

    (loss, exps, correct, grad), (ref_loss, ref_exps, ref_correct, ref_grad) = both(run)
    rel = float(np.abs(exps - ref_exps).max())  # the exponentials are <= 1
    print(f"cross-entropy: loss {loss:.6f} vs {ref_loss:.6f}, exps max abs diff {rel:.2e}")
    assert abs(loss - ref_loss) <= 1e-5 and correct == ref_correct
    np.testing.assert_allclose(exps, ref_exps, rtol=2e-6, atol=1e-37)
    # the gradient is (softmax - onehot) * 0.5 / 128: rtol 2e-6 of 4e-3
    assert_close("cross-entropy grad", (grad,), (ref_grad,), atol=1e-8)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_fused_is_bit_identical(weight_decay):
    rng = _rng()
    init = rng.standard_normal(100_003).astype(np.float32)
    grads = [rng.standard_normal(init.size).astype(np.float32) for _ in range(3)]

    def run():
        p = init.copy()
        opt = AdamW(p, lr=1e-3, weight_decay=weight_decay)
        for g in grads:
            opt.step(g)
        return p, opt.m, opt.v, opt.fused

    fast, reference = both(run)
    assert fast[3] and not reference[3]
    for f, r in zip(fast[:3], reference[:3], strict=True):
        np.testing.assert_array_equal(f, r)
