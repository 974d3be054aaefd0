"""Embedding, CausalAttention and Residual: finite differences (float64), contracts, causality."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpihybrid.nn.layers import GELU, Layer, LayerNorm, Linear
from mpihybrid.nn.transformer import CausalAttention, Embedding, Residual
from tests.test_layers import assert_weight_grads_accumulate, bound, numeric_grad

# b = sequences, T = tokens per sequence, C = width, h = heads, V = vocabulary
b, T, C, H, V = 2, 5, 8, 2, 11


def tokens(rng: np.random.Generator, length: int = T) -> np.ndarray:
    x = rng.integers(0, V, size=(b, length))
    x[1, 1] = x[0, 0]  # a repeated token: its gradient rows must add up, not overwrite
    x[1, 2] = x[0, 0]
    return x


def attention_branch() -> list[Layer]:
    return [LayerNorm(C), Linear(C, 3 * C), CausalAttention(C, H, T), Linear(C, C)]


def make(name: str) -> Layer:
    """A float64 layer with its own perturbed parameters."""
    if name == "embedding":
        return bound(Embedding(V, T, C))
    if name == "attention":
        return CausalAttention(C, H, T)
    if name == "residual-ln-linear":
        return bound(Residual([LayerNorm(C), Linear(C, C)]))
    if name == "residual-attention":
        return bound(Residual(attention_branch()))
    if name == "residual-mlp":
        return bound(Residual([LayerNorm(C), Linear(C, 2 * C), GELU(), Linear(2 * C, C)]))
    raise KeyError(name)


def inputs(name: str, rng: np.random.Generator) -> np.ndarray:
    if name == "embedding":
        return tokens(rng)
    if name == "attention":
        return rng.standard_normal((b, T, 3 * C))
    return rng.standard_normal((b, T, C))


ALL = ["embedding", "attention", "residual-ln-linear", "residual-attention", "residual-mlp"]
WITH_WEIGHTS = [n for n in ALL if n != "attention"]


@pytest.mark.parametrize("name", ALL)
def test_gradients_match_finite_differences(name):
    layer = make(name)
    rng = np.random.default_rng(1)
    x = inputs(name, rng)
    y, cache = layer.forward(x)
    dy = rng.standard_normal(y.shape)

    def f() -> float:
        # sum(y * dy): its gradient with respect to y is exactly dy
        return float(np.sum(layer.forward(x)[0] * dy))

    dx = layer.backward(dy, cache)
    if name == "embedding":
        assert dx is None  # integer tokens have no gradient
    else:
        diff = np.max(np.abs(dx - numeric_grad(f, x)))
        print(f"{name}: max |dx - numeric| = {diff:.2e} (max |dx| {np.abs(dx).max():.2e})")
        assert np.abs(dx).max() > 1e-3
        assert diff < 1e-7
    assert len(layer.params) == len(layer.param_shapes())
    for pname, p in layer.params.items():
        grad = layer.grads[pname]
        diff = np.max(np.abs(grad - numeric_grad(f, p)))
        print(f"{name}: max |d{pname} - numeric| = {diff:.2e} (max {np.abs(grad).max():.2e})")
        assert np.abs(grad).max() > 1e-3, pname
        assert diff < 1e-7, pname


@pytest.mark.parametrize("name", ALL)
def test_backward_equals_input_then_weight(name):
    whole, split = make(name), make(name)
    x = inputs(name, np.random.default_rng(2))
    y, cache = whole.forward(x)
    dy = np.random.default_rng(3).standard_normal(y.shape)
    dx_whole = whole.backward(dy, cache)

    _, cache = split.forward(x)
    dx_split, wcache = split.backward_input(dy, cache)
    for g in split.grads.values():
        assert not g.any(), "backward_input must not touch weight gradients"
    split.backward_weight(wcache)

    if name == "embedding":
        assert dx_whole is None and dx_split is None
    else:
        np.testing.assert_array_equal(dx_whole, dx_split)
    assert whole.grads.keys() == split.grads.keys()
    for pname in whole.grads:
        assert whole.grads[pname].any(), pname
        np.testing.assert_array_equal(whole.grads[pname], split.grads[pname])


@pytest.mark.parametrize("name", WITH_WEIGHTS)
def test_weight_gradients_accumulate(name):
    rng = np.random.default_rng(4)
    assert_weight_grads_accumulate(make(name), inputs(name, rng), inputs(name, rng), rng)


def test_embedding_is_a_lookup_plus_position():
    emb = make("embedding")
    x = tokens(np.random.default_rng(5), length=T - 2)  # shorter than seq_len: first positions
    y, cache = emb.forward(x)
    assert y.shape == (b, T - 2, C)
    for i in range(b):
        for t in range(T - 2):
            expected = emb.params["tokens"][x[i, t]] + emb.params["positions"][t]
            np.testing.assert_array_equal(y[i, t], expected)
    emb.backward(np.ones_like(y), cache)
    # a token that occurs k times gets k rows of gradient; unused positions get none
    counts = np.bincount(x.ravel(), minlength=V)
    np.testing.assert_array_equal(emb.grads["tokens"], np.repeat(counts[:, None], C, axis=1))
    np.testing.assert_array_equal(emb.grads["positions"][: T - 2], b)
    assert not emb.grads["positions"][T - 2 :].any()


def naive_attention(qkv: np.ndarray, heads: int) -> np.ndarray:
    """Loops over sequences, heads and positions: softmax(q k^T / sqrt(d)) v over j <= t."""
    nb, nt, three_c = qkv.shape
    c = three_c // 3
    d = c // heads
    y = np.zeros((nb, nt, c))
    for i in range(nb):
        for h in range(heads):
            q = qkv[i, :, h * d : (h + 1) * d]
            k = qkv[i, :, c + h * d : c + (h + 1) * d]
            v = qkv[i, :, 2 * c + h * d : 2 * c + (h + 1) * d]
            for t in range(nt):
                s = np.array([q[t] @ k[j] for j in range(t + 1)]) / math.sqrt(d)
                p = np.exp(s - s.max())
                p /= p.sum()
                y[i, t, h * d : (h + 1) * d] = p @ v[: t + 1]
    return y


@pytest.mark.parametrize("length", [T, T - 2])
def test_attention_matches_naive_reference(length):
    qkv = 2.0 * np.random.default_rng(6).standard_normal((b, length, 3 * C))
    y, _ = CausalAttention(C, H, T).forward(qkv)
    diff = np.max(np.abs(y - naive_attention(qkv, H)))
    print(f"max |attention - naive| = {diff:.2e}")
    assert y.shape == (b, length, C)
    assert diff < 1e-13
    # one head would mix all channels: the head split is part of what is checked
    assert np.max(np.abs(y - naive_attention(qkv, 1))) > 1e-2


def test_attention_is_causal():
    attn = CausalAttention(C, H, T)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((b, T, 3 * C))
    y, _ = attn.forward(x)
    for t in range(T):
        x2 = x.copy()
        x2[:, t] += rng.standard_normal((b, 3 * C))
        y2, _ = attn.forward(x2)
        np.testing.assert_array_equal(y2[:, :t], y[:, :t])
        assert np.abs(y2[:, t] - y[:, t]).min() > 0
    # the input gradient of position s reaches no position after s
    for s in range(T):
        _, cache = attn.forward(x)
        dy = np.zeros((b, T, C))
        dy[:, s] = rng.standard_normal((b, C))
        dx, _ = attn.backward_input(dy, cache)
        assert not dx[:, s + 1 :].any()
        assert np.abs(dx[:, : s + 1]).max() > 0


def test_attention_rejects_width_not_divisible_by_heads():
    with pytest.raises(ValueError, match="width 10 is not divisible by heads 4"):
        CausalAttention(10, 4, T)


def test_residual_adds_the_skip_and_exposes_branch_parameters():
    res = make("residual-ln-linear")
    assert set(res.param_shapes()) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    ln, lin = res.branch
    for key, p in res.params.items():
        i, name = key.split(".")
        assert np.shares_memory(p, res.branch[int(i)].params[name])
        assert np.shares_memory(res.grads[key], res.branch[int(i)].grads[name])
    x = np.random.default_rng(8).standard_normal((b, T, C))
    y, _ = res.forward(x)
    np.testing.assert_allclose(y, x + lin.forward(ln.forward(x)[0])[0], rtol=1e-14, atol=1e-15)
    assert res.flops(3) == lin.flops(3)


@pytest.mark.parametrize("name", ALL)
def test_float32_in_float32_out(name):
    layer = make(name)
    for key in list(layer.params):
        layer.params[key] = layer.params[key].astype(np.float32)
        layer.grads[key] = np.zeros_like(layer.params[key])
    layer.bind(layer.params, layer.grads)
    x = inputs(name, np.random.default_rng(9))
    if name != "embedding":
        x = x.astype(np.float32)
    y, cache = layer.forward(x)
    assert y.dtype == np.float32
    dx = layer.backward(np.ones_like(y), cache)
    assert dx is None if name == "embedding" else dx.dtype == np.float32
    for g in layer.grads.values():
        assert g.dtype == np.float32 and g.any()
