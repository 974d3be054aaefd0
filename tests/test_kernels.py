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
from mpihybrid.nn.layers import GELU, LayerNorm, Linear
from mpihybrid.nn.optim import AdamW
from mpihybrid.nn.transformer import CausalAttention, Embedding, Residual

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


def test_no_cross_entropy_kernel():
    # numpy's vectorised exp beat the fused pass (0.7-0.8x, benchmarks/kernel_ab.py): gone
    assert not hasattr(kernels, "cross_entropy_forward")


def _linear(rng, fan_in: int, fan_out: int) -> Linear:
    layer = Linear(fan_in, fan_out)
    params = {
        "weight": (0.2 * rng.standard_normal((fan_in, fan_out))).astype(np.float32),
        "bias": rng.standard_normal(fan_out).astype(np.float32),
    }
    layer.bind(params, {k: np.zeros_like(v) for k, v in params.items()})
    return layer


def test_bias_gelu_and_bias_residual_fused_in_a_branch():
    # LayerNorm, Linear(C, F) + GELU (bias in the GELU's pass), Linear(F, C) + bias + skip
    rng = _rng()
    x = rng.standard_normal((b, T, C)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    up, down = _linear(rng, C, F), _linear(rng, F, C)
    norm = LayerNorm(C)
    norm.bind(
        {"weight": np.ones(C, np.float32), "bias": np.zeros(C, np.float32)},
        {"weight": np.zeros(C, np.float32), "bias": np.zeros(C, np.float32)},
    )
    branch = Residual([norm, up, GELU(), down])
    assert up.bias_to_next and branch.branch[2].bias_from is up and not down.bias_to_next

    def run():
        for layer in (norm, up, down):
            for g in layer.grads.values():
                g[...] = 0.0
        y, cache = branch.forward(x)
        dx = branch.backward(dy, cache)
        return y, dx, up.grads["weight"].copy(), up.grads["bias"].copy(), down.grads["bias"].copy()

    # GELU's tolerances (its tanh), through the down projection's 40-term sums
    assert_close("bias+gelu branch", *both(run), atol=(5e-6, 1e-5, 5e-5, 1e-5, 1e-6))


def test_bias_residual_add_is_bit_identical():
    rng = _rng()
    layer = _linear(rng, C, C)
    x = rng.standard_normal((b, T, C)).astype(np.float32)
    skip = rng.standard_normal((b, T, C)).astype(np.float32)
    fast, reference = both(lambda: layer.forward(x, skip=skip)[0])
    np.testing.assert_array_equal(fast, reference)


def test_embedding_backward_matches_add_at():
    rng = _rng()
    vocab = 50
    tokens = rng.integers(0, vocab, (b, T))
    tokens[0, :5] = 7  # repeated tokens: their rows add up
    dy = rng.standard_normal((b, T, C)).astype(np.float32)
    expected = np.zeros((vocab, C), np.float32)
    np.add.at(expected, tokens.reshape(-1), dy.reshape(-1, C))

    def run():
        layer = Embedding(vocab, T, C)
        shapes = {"tokens": (vocab, C), "positions": (T, C)}
        grads = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        layer.bind({k: np.zeros(s, np.float32) for k, s in shapes.items()}, grads)
        layer.backward(dy, tokens)
        return grads["tokens"], grads["positions"]

    fast, reference = both(run)
    # the kernel adds in np.add.at's order, which the reference and a device's scatter-add use:
    # the same bits on the host, with or without numba, and on a GPU
    np.testing.assert_array_equal(fast[0], expected)
    np.testing.assert_array_equal(reference[0], expected)
    assert_close("embedding", fast, reference, atol=0)


def test_gpt_stage_with_kernels_matches_the_references():
    # the whole model, every kernel at once: logits, input gradient and every parameter's gradient
    from mpihybrid.config import load_job
    from mpihybrid.nn.data import task_dims
    from mpihybrid.nn.model import build_stage

    job = load_job("jobs/gpt_learn.toml", ["grid.pp=1"], 1)
    rng = _rng()
    vocab_in, vocab = task_dims(job.data)
    tokens = rng.integers(0, vocab, (4, vocab_in))

    def run():
        stage = build_stage(job.model, vocab_in, vocab, 0, 1, seed=0)
        logits, cache = stage.forward(tokens)
        out = logits.copy()
        dy = rng_dy(logits.shape)
        stage.backward(dy, cache, need_dx=False)
        return out, stage.flat_grads.copy()

    def rng_dy(shape):
        return np.random.default_rng(5).standard_normal(shape).astype(np.float32)

    fast, reference = both(run)
    scale = float(np.abs(reference[1]).max())
    print(f"gpt: largest gradient {scale:.2e}")
    assert_close("gpt", fast, reference, atol=(1e-5, 1e-6 * max(scale, 1.0)))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_fused_is_bit_identical(weight_decay):
    rng = _rng()
    init = rng.standard_normal(100_003).astype(np.float32)
    grads = [rng.standard_normal(init.size).astype(np.float32) for _ in range(3)]

    def run():
        p = init.copy()
        opt = AdamW(p, lr=1e-3, weight_decay=weight_decay)
        for coef, g in zip([1.0, 0.3, 1.0], grads, strict=True):
            opt.begin_step()
            opt.scale_gradients(coef)  # train.grad_clip's coefficient, inside the pass
            opt.update(g.copy(), 0, g.size)
        return p, opt.m, opt.v, opt.fused

    fast, reference = both(run)
    assert fast[3] and not reference[3]
    for f, r in zip(fast[:3], reference[:3], strict=True):
        np.testing.assert_array_equal(f, r)


# ---- the llama kind's layers: RMSNorm, SwiGLU, the rotary embedding ---------------------------


def test_rmsnorm_forward_backward():
    from mpihybrid.nn.llama import RMSNorm

    rng = _rng()
    x = (rng.standard_normal((b, T, C)) * 2 + 0.5).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(C)).astype(np.float32)

    def run():
        layer = RMSNorm(C)
        grads = {"weight": np.full(C, 0.5, np.float32)}
        layer.bind({"weight": w}, grads)
        y, cache = layer.forward(x)
        dx = layer.backward(dy, cache)  # the weight gradient accumulates onto 0.5
        return y, dx, grads["weight"]

    assert_close("rmsnorm", *both(run), atol=1e-5)


def test_swiglu_forward_backward():
    from mpihybrid.nn.llama import SwiGLU

    rng = _rng()
    x = rng.standard_normal((b, T, 2 * F)).astype(np.float32)
    dy = rng.standard_normal((b, T, F)).astype(np.float32)

    def run():
        y, cache = SwiGLU().forward(x)
        return y, SwiGLU().backward(dy, cache)

    assert_close("swiglu", *both(run), atol=(1e-6, 1e-5))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_rotary_pack_and_unpack(kv_heads):
    """q and k rotated into the attention core's layout, each kv head repeated (rotary_pack),
    and back, the repeats summed (rotary_unpack)."""
    from mpihybrid.nn.llama import RotaryAttention

    rng = _rng()
    x = rng.standard_normal((b, T, C + 2 * kv_heads * (C // HEADS))).astype(np.float32)
    dpacked = rng.standard_normal((b, T, 3 * C)).astype(np.float32)

    def run():
        layer = RotaryAttention(C, HEADS, kv_heads, T)
        return layer.pack(x).reshape(b, T, 3 * C), layer.unpack(dpacked)

    fast, reference = both(run)
    assert np.array_equal(fast[0], reference[0])  # rotary_pack: bit for bit
    assert_close(f"rotary (kv {kv_heads})", fast, reference, atol=1e-6)


def test_llama_stage_with_kernels_matches_the_references():
    from mpihybrid.config import load_job
    from mpihybrid.nn.data import task_dims
    from mpihybrid.nn.model import build_stage

    sets = ["grid.pp=1", "model.kind=llama", "model.kv_heads=2", "model.ffn=100"]
    job = load_job("jobs/gpt_learn.toml", sets, 1)
    vocab_in, vocab = task_dims(job.data)
    tokens = _rng().integers(0, vocab, (4, vocab_in))

    def run():
        stage = build_stage(job.model, vocab_in, vocab, 0, 1, seed=0)
        stage.flat_params += np.random.default_rng(2).standard_normal(stage.num_params).astype(
            np.float32
        ) * np.float32(0.05)  # off the tiny init: every layer's output matters
        logits, cache = stage.forward(tokens)
        out = logits.copy()
        dy = np.random.default_rng(5).standard_normal(logits.shape).astype(np.float32)
        stage.backward(dy, cache, need_dx=False)
        return out, stage.flat_grads.copy()

    fast, reference = both(run)
    scale = float(np.abs(reference[1]).max())
    print(f"llama: largest gradient {scale:.2e}")
    assert_close("llama", fast, reference, atol=(1e-4, 1e-5 * max(scale, 1.0)))
