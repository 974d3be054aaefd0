"""model.vocab_parallel's math (nn/vocab.py): the loss from per-share softmax statistics equals a
plain softmax cross-entropy on the same logits (hand-made, padded, with ties), its gradients
equal the unsplit head's and finite differences; the shares' embedding sums to the lookup."""

from __future__ import annotations

import numpy as np
import pytest

from mpihybrid.nn.layers import Linear
from mpihybrid.nn.loss import SoftmaxCrossEntropy
from mpihybrid.nn.transformer import Embedding
from mpihybrid.nn.vocab import VocabShard, combine, padding, shard_tensors, share_size

C = 5


def _shards(vocab, pp, tied, w, b, table):
    shards = []
    for r in range(pp):
        sh = VocabShard(vocab, pp, r, 4, C, tied=tied, seed=0, num_blocks=3)
        params = {k: np.zeros(s, np.float32) for k, s in sh.param_shapes().items()}
        grads = {k: np.zeros(s, np.float32) for k, s in sh.param_shapes().items()}
        sh.bind(params, grads)
        lo, n = sh.lo, sh.real
        params["tokens"][:n] = table[lo : lo + n]
        params["bias"][:n] = b[lo : lo + n]
        if not tied:
            params["head"][:, :n] = w[:, lo : lo + n]
        shards.append(sh)
    return shards


def _loss_and_grads(shards, h, targets, scale):
    caches, stats = zip(*(sh.logits(h, targets) for sh in shards), strict=True)
    total = combine(list(stats))
    out = [sh.head_backward(c, total, scale) for sh, c in zip(shards, caches, strict=True)]
    return out[0][0], out[0][1], sum(o[2] for o in out)


@pytest.mark.parametrize("vocab, pp, tied", [(12, 3, False), (7, 3, False), (7, 2, True),
                                             (5, 4, True)])  # fmt: skip
def test_shares_give_the_plain_softmax_loss_and_gradients(vocab, pp, tied):
    rng = np.random.default_rng(1)
    h = rng.standard_normal((2, 3, C)).astype(np.float32)
    targets = rng.integers(0, vocab, (2, 3))
    table = rng.standard_normal((vocab, C)).astype(np.float32)
    w = table.T.copy() if tied else rng.standard_normal((C, vocab)).astype(np.float32)
    b = rng.standard_normal(vocab).astype(np.float32)
    b[1] = b[0] + (w[:, 0] - w[:, 1]) @ h[0, 0]  # a tie of two logits in row 0 (argmax: first)
    head = Linear(C, vocab)
    head.bind({"weight": w.copy(), "bias": b.copy()},
              {"weight": np.zeros_like(w), "bias": np.zeros_like(b)})  # fmt: skip
    logits, cache = head.forward(h)
    ce = SoftmaxCrossEntropy()
    loss, lcache = ce.forward(logits.copy(), targets)
    hits = ce.correct(lcache)
    dh = head.backward(ce.backward(lcache, 0.5), cache)
    shards = _shards(vocab, pp, tied, w, b, table)
    got_loss, got_hits, got_dh = _loss_and_grads(shards, h, targets, 0.5)
    print(f"V={vocab} pp={pp}: |loss diff| {abs(got_loss - loss):.1e}, "
          f"max |dh diff| {np.abs(got_dh - dh).max():.1e}")  # fmt: skip
    assert got_loss == pytest.approx(loss, rel=1e-6)
    assert got_hits == hits
    np.testing.assert_allclose(got_dh, dh, rtol=1e-5, atol=1e-6)
    full = shard_tensors(shards, tied)
    want_w = head.grads["weight"]
    got = np.concatenate([sh.weight(grads=True) for sh in shards], axis=1)[:, :vocab]
    np.testing.assert_allclose(got, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.concatenate([sh.grads["bias"] for sh in shards])[:vocab], head.grads["bias"],
        rtol=1e-5, atol=1e-6)  # fmt: skip
    assert full["head"].shape == (C, vocab) and full["tokens"].shape == (vocab, C)
    for sh in shards:  # padding: zero weights, zero gradients
        assert not sh.grads["bias"][sh.real :].any()


def test_loss_gradient_matches_finite_differences():
    rng = np.random.default_rng(2)
    vocab, pp = 9, 2
    h = rng.standard_normal((1, 4, C)).astype(np.float32)
    targets = rng.integers(0, vocab, (1, 4))
    w = rng.standard_normal((C, vocab)).astype(np.float32)
    b = rng.standard_normal(vocab).astype(np.float32)
    shards = _shards(vocab, pp, False, w, b, np.zeros((vocab, C), np.float32))
    _, _, dh = _loss_and_grads(shards, h, targets, 1.0)
    eps = 1e-2
    for i in [(0, 0, 0), (0, 2, 3), (0, 3, 1)]:
        up, down = h.copy(), h.copy()
        up[i] += eps
        down[i] -= eps
        numeric = (_loss_and_grads(shards, up, targets, 1.0)[0]
                   - _loss_and_grads(shards, down, targets, 1.0)[0]) / (2 * eps)  # fmt: skip
        assert dh[i] == pytest.approx(numeric, rel=2e-2, abs=1e-3)


def test_shares_of_the_embedding_sum_to_the_lookup_and_its_gradient():
    rng = np.random.default_rng(3)
    vocab, pp = 11, 3
    table = rng.standard_normal((vocab, C)).astype(np.float32)
    emb = Embedding(vocab, 4, C)
    emb.bind({"tokens": table.copy(), "positions": np.zeros((4, C), np.float32)},
             {"tokens": np.zeros((vocab, C), np.float32),
              "positions": np.zeros((4, C), np.float32)})  # fmt: skip
    tokens = rng.integers(0, vocab, (3, 4))
    y, cache = emb.forward(tokens)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    emb.backward(dy, cache, need_dx=False)
    shards = _shards(vocab, pp, True, table.T, np.zeros(vocab, np.float32), table)
    parts = [sh.embed(tokens) for sh in shards]
    np.testing.assert_array_equal(sum(parts), y)  # one share holds each row: exact
    for sh in shards:
        sh.embed_grad(tokens, dy)
    grad = np.concatenate([sh.grads["tokens"] for sh in shards])[:vocab]
    np.testing.assert_array_equal(grad, emb.grads["tokens"])


def test_padding_is_the_round_up():
    assert share_size(50257, 2) == 25129 and padding(50257, 2) == 1
    assert padding(12, 3) == 0 and padding(5, 4) == 3
