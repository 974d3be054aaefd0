"""Blocks, partitioning, and stages: any split of the model is the unsplit model."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from mpihybrid.nn.layers import GELU, LayerNorm, Linear, ReLU
from mpihybrid.nn.loss import SoftmaxCrossEntropy
from mpihybrid.nn.model import (
    Stage,
    block_num_params,
    build_blocks,
    build_stage,
    partition,
    stage_ranges,
)

# B = rows of a batch, C = features, K = classes
B, C_IN, K = 6, 7, 3


def mlp(depth=4, hidden=8, activation="relu", norm=True, kind="mlp", partition="cost"):
    return SimpleNamespace(
        kind=kind, hidden=hidden, depth=depth, activation=activation, norm=norm, partition=partition
    )


def brute_force_best(counts: list[int], k: int) -> int:
    n = len(counts)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(counts[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


def test_partition_is_optimal_on_small_cases():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(1, 8))
        k = int(rng.integers(1, n + 1))
        counts = [int(c) for c in rng.integers(0, 50, size=n)]
        ranges = partition(counts, k)
        assert len(ranges) == k
        assert ranges[0].start == 0 and ranges[-1].stop == n
        for r, nxt in itertools.pairwise(ranges):
            assert r.stop == nxt.start
        assert all(len(r) > 0 for r in ranges)
        worst = max(sum(counts[i] for i in r) for r in ranges)
        assert worst == brute_force_best(counts, k), (counts, k, ranges)
        assert partition(counts, k) == ranges


def test_partition_balances_beyond_the_largest_chunk():
    # the 100 fixes the maximum; the other chunks should still split 10 10 10 10 evenly
    ranges = partition([10, 10, 10, 10, 100], 3)
    assert ranges == [range(0, 2), range(2, 4), range(4, 5)]


def test_partition_rejects_too_many_chunks():
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4"):
        partition([1, 2, 3], 4)
    with pytest.raises(ValueError, match="num_chunks"):
        partition([1, 2, 3], 0)
    with pytest.raises(ValueError, match="cannot split 4 blocks into 5"):
        stage_ranges(mlp(depth=4), C_IN, K, 5)


def test_build_blocks_structure():
    blocks = build_blocks(mlp(depth=3, activation="gelu", norm=True), C_IN, K)
    assert [[type(layer) for layer in b] for b in blocks] == [
        [Linear, LayerNorm, GELU],
        [Linear, LayerNorm, GELU],
        [Linear],
    ]
    assert (blocks[0][0].in_features, blocks[0][0].out_features) == (C_IN, 8)
    assert (blocks[2][0].in_features, blocks[2][0].out_features) == (8, K)
    assert block_num_params(blocks[0]) == C_IN * 8 + 8 + 2 * 8

    linear_model = build_blocks(mlp(depth=1, norm=False), C_IN, K)
    assert len(linear_model) == 1 and len(linear_model[0]) == 1
    assert linear_model[0][0].param_shapes() == {"weight": (C_IN, K), "bias": (K,)}

    no_norm = build_blocks(mlp(depth=2, norm=False), C_IN, K)
    assert [type(layer) for layer in no_norm[0]] == [Linear, ReLU]


@pytest.mark.parametrize(
    "cfg, match",
    [
        (mlp(kind="cnn"), "kind"),
        (mlp(depth=0), "depth"),
        (mlp(activation="tanh"), "activation"),
    ],
)
def test_build_blocks_rejects_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_blocks(cfg, C_IN, K)


def chained(stages: list[Stage], x: np.ndarray, targets: np.ndarray, split_backward: bool):
    """Forward through the stages in order, loss, backward in reverse; returns (logits, dx)."""
    caches = []
    for stage in stages:
        x, cache = stage.forward(x)
        caches.append(cache)
    loss_fn = SoftmaxCrossEntropy()
    _, loss_cache = loss_fn.forward(x.copy(), targets)  # the loss works in place
    dy = loss_fn.backward(loss_cache)
    for stage, cache in zip(reversed(stages), reversed(caches), strict=True):
        if split_backward:
            dy, wcache = stage.backward_input(dy, cache)
            stage.backward_weight(wcache)
        else:
            dy = stage.backward(dy, cache)
    return x, dy


@pytest.mark.parametrize("cfg", [mlp(), mlp(depth=5, activation="gelu", norm=False)], ids=str)
def test_split_model_equals_unsplit_model(cfg):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, C_IN))
    targets = rng.integers(0, K, size=B)
    whole = build_stage(cfg, C_IN, K, 0, 1, seed=3, dtype=np.float64)
    assert whole.block_range == range(cfg.depth)
    logits, dx = chained([whole], x, targets, split_backward=False)
    assert whole.flat_grads.any()

    for num_chunks in range(1, cfg.depth + 1):
        stages = [
            build_stage(cfg, C_IN, K, c, num_chunks, seed=3, dtype=np.float64)
            for c in range(num_chunks)
        ]
        assert [s.block_range for s in stages] == stage_ranges(cfg, C_IN, K, num_chunks)
        flat = np.concatenate([s.flat_params for s in stages])
        np.testing.assert_array_equal(flat, whole.flat_params)
        assert sum(s.flops(B) for s in stages) == whole.flops(B)
        for split_backward in (False, True):
            for s in stages:
                s.zero_grad()
            split_logits, split_dx = chained(stages, x, targets, split_backward)
            np.testing.assert_allclose(split_logits, logits, rtol=1e-13, atol=1e-15)
            np.testing.assert_allclose(split_dx, dx, rtol=1e-13, atol=1e-15)
            grads = np.concatenate([s.flat_grads for s in stages])
            np.testing.assert_allclose(grads, whole.flat_grads, rtol=1e-13, atol=1e-15)


def test_seed_changes_parameters_and_float32_matches_float64_init():
    a = build_stage(mlp(), C_IN, K, 0, 1, seed=0)
    b = build_stage(mlp(), C_IN, K, 0, 1, seed=1)
    c = build_stage(mlp(), C_IN, K, 0, 1, seed=0, dtype=np.float64)
    assert a.flat_params.dtype == np.float32 and a.flat_grads.dtype == np.float32
    assert not np.array_equal(a.flat_params, b.flat_params)
    np.testing.assert_array_equal(a.flat_params, c.flat_params.astype(np.float32))


def test_flat_buffers_alias_the_layers():
    stage = build_stage(mlp(depth=3), C_IN, K, 0, 1, seed=0)
    x = np.random.default_rng(2).standard_normal((B, C_IN)).astype(np.float32)
    offset = 0
    for layer in stage.layers:
        for name, p in layer.params.items():
            assert np.shares_memory(p, stage.flat_params)
            assert np.shares_memory(layer.grads[name], stage.flat_grads)
            np.testing.assert_array_equal(p.ravel(), stage.flat_params[offset : offset + p.size])
            offset += p.size
    assert offset == stage.num_params == stage.flat_params.size

    before, _ = stage.forward(x)
    head_bias = stage.layers[-1].params["bias"]
    stage.flat_params[-K:] += 5.0  # the head's bias is the last thing in the buffer
    after, cache = stage.forward(x)
    np.testing.assert_array_equal(head_bias, stage.flat_params[-K:])
    np.testing.assert_allclose(after, before + 5.0, rtol=1e-6)

    stage.backward(np.ones_like(after), cache)
    assert np.array_equal(stage.layers[-1].grads["bias"], np.full(K, B, np.float32))
    stage.zero_grad()
    assert not any(g.any() for layer in stage.layers for g in layer.grads.values())


def test_activation_nbytes_counts_what_the_cache_holds():
    # depth 1 is one Linear, which caches only its input
    linear = build_stage(mlp(depth=1), C_IN, K, 0, 1, seed=0)
    x = np.zeros((B, C_IN), np.float32)
    _, cache = linear.forward(x)
    assert linear.activation_nbytes(cache) == x.nbytes

    # a micro-batch sliced from a bigger array counts only its own rows
    data = np.zeros((10 * B, C_IN), np.float32)
    _, cache = linear.forward(data[B : 2 * B])
    assert linear.activation_nbytes(cache) == B * C_IN * 4

    # [Linear, ReLU] + [Linear]: input, the ReLU mask (1 byte), the hidden output
    stage = build_stage(mlp(depth=2, norm=False), C_IN, K, 0, 1, seed=0)
    _, cache = stage.forward(x)
    hidden = 8
    assert stage.activation_nbytes(cache) == B * C_IN * 4 + B * hidden * (1 + 4)
    _, cache2 = stage.forward(np.zeros((2 * B, C_IN), np.float32))
    assert stage.activation_nbytes(cache2) == 2 * stage.activation_nbytes(cache)


def test_build_stage_rejects_bad_chunk():
    with pytest.raises(ValueError, match="chunk"):
        build_stage(mlp(), C_IN, K, 2, 2, seed=0)


@pytest.mark.parametrize("split", [False, True])
def test_first_stage_skips_its_input_gradient_only(split):
    stage = build_stage(mlp(depth=3), 5, 3, 0, 1, seed=2, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((4, 5))
    y, cache = stage.forward(x)
    dy = np.ones_like(y)
    grads = []
    for need_dx in (True, False):
        stage.zero_grad()
        if split:
            dx, wcache = stage.backward_input(dy, cache, need_dx)
            stage.backward_weight(wcache)
        else:
            dx = stage.backward(dy, cache, need_dx)
        assert (dx is None) == (not need_dx)
        grads.append(stage.flat_grads.copy())
    np.testing.assert_array_equal(grads[0], grads[1])
