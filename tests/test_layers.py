"""Layer gradients against central finite differences (float64), and the backward contracts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpihybrid.nn.layers import GELU, Layer, LayerNorm, Linear, ReLU
from mpihybrid.nn.loss import SoftmaxCrossEntropy

# B = rows, C = features, K = classes
B, C_IN, C_OUT = 4, 5, 3
EPS = 1e-6


def bound(layer: Layer, seed: int = 0, dtype=np.float64) -> Layer:
    """Give `layer` its own parameter/gradient arrays; perturb the params off their init."""
    rng = np.random.default_rng(seed)
    params = {k: np.zeros(s, dtype) for k, s in layer.param_shapes().items()}
    grads = {k: np.zeros(s, dtype) for k, s in layer.param_shapes().items()}
    layer.init_params(params, rng)
    for p in params.values():
        # zero bias / unit gamma would hide some gradient terms
        p += 0.3 * rng.standard_normal(p.shape)
    layer.bind(params, grads)
    return layer


def make_layers() -> dict[str, Layer]:
    return {
        "linear": bound(Linear(C_IN, C_OUT)),
        "linear_nobias": bound(Linear(C_IN, C_OUT, bias=False)),
        "relu": ReLU(),
        "gelu": GELU(),
        "layernorm": bound(LayerNorm(C_IN)),
    }


def numeric_grad(f, a: np.ndarray) -> np.ndarray:
    """Central differences of the scalar f() with respect to every element of `a` (in place)."""
    g = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        old = a[idx]
        a[idx] = old + EPS
        up = f()
        a[idx] = old - EPS
        down = f()
        a[idx] = old
        g[idx] = (up - down) / (2 * EPS)
    return g


def inputs(name: str, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((B, C_IN))
    if name == "relu":
        # keep inputs away from the kink at 0, where finite differences are meaningless
        x = np.where(np.abs(x) < 0.1, 0.5, x)
    return x


@pytest.mark.parametrize("name", ["linear", "linear_nobias", "relu", "gelu", "layernorm"])
def test_gradients_match_finite_differences(name):
    layer = make_layers()[name]
    rng = np.random.default_rng(1)
    x = inputs(name, rng)
    y, cache = layer.forward(x)
    dy = rng.standard_normal(y.shape)

    def f() -> float:
        # a loss whose gradient with respect to y is exactly dy
        return float(np.sum(layer.forward(x)[0] * dy))

    dx = layer.backward(dy, cache)
    diff = np.max(np.abs(dx - numeric_grad(f, x)))
    print(f"{name}: max |dx - numeric| = {diff:.2e}")
    assert diff < 1e-7
    for pname, p in layer.params.items():
        diff = np.max(np.abs(layer.grads[pname] - numeric_grad(f, p)))
        print(f"{name}: max |d{pname} - numeric| = {diff:.2e}")
        assert diff < 1e-7


@pytest.mark.parametrize("name", ["linear", "linear_nobias", "relu", "gelu", "layernorm"])
def test_backward_equals_input_then_weight(name):
    whole, split = make_layers()[name], make_layers()[name]
    x = inputs(name, np.random.default_rng(2))
    y, cache = whole.forward(x)
    dy = np.random.default_rng(3).standard_normal(y.shape)
    dx_whole = whole.backward(dy, cache)

    _, cache = split.forward(x)
    dx_split, wcache = split.backward_input(dy, cache)
    for g in split.grads.values():
        assert not g.any(), "backward_input must not touch weight gradients"
    split.backward_weight(wcache)

    np.testing.assert_array_equal(dx_whole, dx_split)
    for pname in whole.grads:
        np.testing.assert_array_equal(whole.grads[pname], split.grads[pname])


@pytest.mark.parametrize("name", ["linear", "layernorm"])
def test_weight_gradients_accumulate(name):
    rng = np.random.default_rng(4)
    x1, x2 = rng.standard_normal((B, C_IN)), rng.standard_normal((B, C_IN))
    assert_weight_grads_accumulate(make_layers()[name], x1, x2, rng)


def assert_weight_grads_accumulate(layer, x1, x2, rng) -> None:
    """Two backward passes leave the sum of their weight gradients (nothing overwritten)."""
    y1, cache1 = layer.forward(x1)
    y2, cache2 = layer.forward(x2)
    dy1, dy2 = rng.standard_normal(y1.shape), rng.standard_normal(y2.shape)

    layer.backward(dy2, cache2)
    only_second = {k: g.copy() for k, g in layer.grads.items()}
    for g in layer.grads.values():
        g[...] = 0
    layer.backward(dy1, cache1)
    only_first = {k: g.copy() for k, g in layer.grads.items()}
    layer.backward(dy2, cache2)
    for k, g in layer.grads.items():
        assert np.abs(only_second[k]).max() > 0, k
        np.testing.assert_allclose(g, only_first[k] + only_second[k], rtol=1e-12, atol=1e-15)


def test_leading_dimensions_are_rows():
    # (B, T, C) inputs must give the same result as (B*T, C): weight grads sum over both
    layer = make_layers()["linear"]
    ln = make_layers()["layernorm"]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, C_IN))
    for lay in (layer, ln):
        y3, c3 = lay.forward(x)
        dy = rng.standard_normal(y3.shape)
        dx3 = lay.backward(dy, c3)
        g3 = {k: g.copy() for k, g in lay.grads.items()}
        for g in lay.grads.values():
            g[...] = 0
        y2, c2 = lay.forward(x.reshape(6, C_IN))
        dx2 = lay.backward(dy.reshape(6, -1), c2)
        np.testing.assert_allclose(y3.reshape(6, -1), y2, rtol=1e-12)
        np.testing.assert_allclose(dx3.reshape(6, -1), dx2, rtol=1e-12)
        for k in g3:
            np.testing.assert_allclose(g3[k], lay.grads[k], rtol=1e-12)


@pytest.mark.parametrize("layer", [Linear(C_IN, C_OUT), ReLU(), GELU(), LayerNorm(C_IN)], ids=repr)
def test_float32_in_float32_out(layer):
    bound(layer, dtype=np.float32)
    x = np.random.default_rng(6).standard_normal((B, C_IN)).astype(np.float32)
    y, cache = layer.forward(x)
    dx = layer.backward(np.ones_like(y), cache)
    assert y.dtype == np.float32 and dx.dtype == np.float32
    for g in layer.grads.values():
        assert g.dtype == np.float32 and g.any()


def test_linear_init_and_flops():
    layer = Linear(400, 300)
    params = {k: np.full(s, np.nan) for k, s in layer.param_shapes().items()}
    layer.init_params(params, np.random.default_rng(7))
    std = params["weight"].std()
    print(f"weight std {std:.4f} vs sqrt(2/400) = {math.sqrt(2 / 400):.4f}")
    assert abs(std - math.sqrt(2 / 400)) < 0.02 * math.sqrt(2 / 400)
    assert not params["bias"].any()
    assert layer.flops(8) == 2 * 8 * 400 * 300
    assert ReLU().flops(8) == 0


def test_layernorm_init_normalises():
    ln = LayerNorm(16)
    params = {k: np.full(s, np.nan) for k, s in ln.param_shapes().items()}
    ln.init_params(params, np.random.default_rng(0))
    ln.bind(params, {k: np.zeros_like(p) for k, p in params.items()})
    x = np.random.default_rng(8).standard_normal((5, 16)) * 7 + 3
    y, _ = ln.forward(x)
    np.testing.assert_allclose(y.mean(axis=1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=1), 1, rtol=1e-4)  # eps shifts it slightly


def test_gelu_matches_erf_definition():
    x = np.linspace(-5, 5, 101)
    y, _ = GELU().forward(x)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    diff = np.max(np.abs(y - exact))
    print(f"max |gelu_tanh - gelu_erf| = {diff:.2e}")
    assert diff < 1e-3


def test_relu_zeroes_negatives():
    x = np.array([[-2.0, -0.0, 0.5, 3.0]])
    y, cache = ReLU().forward(x)
    np.testing.assert_array_equal(y, [[0, 0, 0.5, 3.0]])
    np.testing.assert_array_equal(ReLU().backward(np.ones_like(x), cache), [[0, 0, 1, 1]])


def test_cross_entropy_value_and_gradient():
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((6, 4))
    targets = rng.integers(0, 4, size=6)
    loss_fn = SoftmaxCrossEntropy()
    loss, cache = loss_fn.forward(logits.copy(), targets)  # works in place on its input
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert isinstance(loss, float)
    assert loss == pytest.approx(-np.mean(np.log(p[np.arange(6), targets])), rel=1e-12)
    assert loss_fn.correct(cache) == int(np.sum(logits.argmax(axis=1) == targets))

    grad = loss_fn.backward(cache).copy()
    numeric = numeric_grad(lambda: loss_fn.forward(logits.copy(), targets)[0], logits)
    diff = np.max(np.abs(grad - numeric))
    print(f"cross-entropy: max |dlogits - numeric| = {diff:.2e}")
    assert diff < 1e-8

    _, cache = loss_fn.forward(logits.copy(), targets)
    np.testing.assert_allclose(loss_fn.backward(cache, scale=0.25), 0.25 * grad, rtol=1e-12)


@pytest.mark.parametrize("piece", [0, 1, 3, 64, 1000])
@pytest.mark.parametrize(
    "shape, classes, dtype",
    [((128,), 10_000, np.float32), ((4, 7), 300, np.float32), ((5,), 3, np.float64)],
)
def test_the_loss_in_pieces_gives_the_wholes_bits(shape, classes, dtype, piece):
    """step (forward, correct and backward in cache-sized pieces of rows, what training runs)
    against the three over the whole matrix: the same loss, count and gradient, bit for bit."""
    rng = np.random.default_rng(3)
    logits = (4 * rng.standard_normal((*shape, classes))).astype(dtype)
    logits[0, ..., :2] = logits.max()  # a tie for the largest: argmax takes the first alike
    targets = rng.integers(0, classes, size=shape)
    loss_fn = SoftmaxCrossEntropy()
    loss, cache = loss_fn.forward(logits.copy(), targets)
    right = loss_fn.correct(cache)
    grad = loss_fn.backward(cache, scale=0.25)
    work = logits.copy()
    got = loss_fn.step(work, targets, 0.25, piece)
    assert got[0] == loss and got[1] == right
    assert got[2].shape == logits.shape and got[2].dtype == dtype
    np.testing.assert_array_equal(got[2], grad)
    assert np.shares_memory(got[2], work)  # in place, as forward and backward are


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4], [0.0, 1e4, 1e4]], dtype=np.float32)
    loss_fn = SoftmaxCrossEntropy()
    loss, cache = loss_fn.forward(logits, np.array([0, 2]))
    # row 0 is certain and right (0); row 1 splits evenly between two classes (log 2)
    assert loss == pytest.approx(math.log(2) / 2, rel=1e-5)
    grad = loss_fn.backward(cache)
    assert grad.dtype == np.float32 and np.isfinite(grad).all()
    np.testing.assert_allclose(grad.sum(axis=1), 0, atol=1e-6)
