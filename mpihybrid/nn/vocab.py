"""model.vocab_parallel: a GPT's token table and LM head split by vocabulary over the pp ranks.

    shard = VocabShard(vocab, pp, r, seq_len, width, tied, seed, num_blocks)  # rank r's rows
    part = shard.embed(tokens)                 # (b, T, C): rows in the share, zeros elsewhere
    shard.embed_grad(tokens, dy)               # the share's rows of the table's gradient
    cache, stats = shard.logits(h, targets)    # partial logits, this share's softmax statistics
    loss, hits, dh = shard.head_backward(cache, combine(all ranks' stats), scale)

Share r holds rows [r Vs, (r+1) Vs) of the table and the same columns of the head's weight and
bias, Vs = ceil(V / pp); rows past V (padding) stay zero and their logits are -inf, so they never
reach the loss. The softmax is computed from per-share statistics (Yeung et al., MLSys 2025): each
share's row max m_r, sum of exp(x - m_r) s_r, the target's logit (where the share holds it) and
whether its own argmax is the target; combined, M = max m_r and S = sum s_r exp(m_r - M), the
loss is log S + M - x_target and share r's softmax is exp(x - m_r) exp(m_r - M) / S. Every rank
combines the same arrays in the same order: the same bits everywhere.

The stages keep the rest: the first block is `Positions` (the position table, added to the sum of
the shares' parts), the last the final LayerNorm alone. Initialised from the unsplit model's draws
(rng([seed, 0]) for the table, rng([seed, last block]) for the head), so any pp holds the serial
model's numbers. N = rows (b T), C = width, Vs = share's columns.
"""

from __future__ import annotations

import numpy as np

from mpihybrid.nn import gemm, kernels
from mpihybrid.nn.layers import Cost, Layer, LayerNorm, _rows

LOWEST = np.finfo(np.float32).min
STATS = 4  # rows of a share's statistics: max, sum of exps, target logit, argmax is target


def share_size(vocab: int, pp: int) -> int:
    """Columns of each share: the vocabulary padded up to a multiple of pp, divided."""
    return -(-vocab // pp)


def padding(vocab: int, pp: int) -> int:
    """Rows (columns) added so pp divides the vocabulary: zero weights, -inf logits."""
    return share_size(vocab, pp) * pp - vocab


class Positions(Layer):
    """The first block under vocab_parallel: y = x + position_table[t], x the summed shares."""

    def __init__(self, vocab: int, seq_len: int, dim: int) -> None:
        super().__init__()
        self.vocab, self.seq_len, self.dim = vocab, seq_len, dim

    def __repr__(self) -> str:
        return f"Positions(seq_len={self.seq_len}, dim={self.dim})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"positions": (self.seq_len, self.dim)}

    def init_params(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        rng.standard_normal((self.vocab, self.dim))  # the token table's draws come first
        params["positions"][...] = rng.standard_normal(params["positions"].shape) * 0.02

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        return x + self.params["positions"][: x.shape[-2]], x.shape[-2]

    def backward_input(self, dy, cache, need_dx: bool = True):
        return dy, (cache, dy)  # the table's gradient: every share takes its rows of dy

    def backward_weight(self, wcache: object) -> None:
        t, dy = wcache
        self.grads["positions"][:t] += dy.reshape(-1, *dy.shape[-2:]).sum(axis=0)

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        c = self._base_cost(self.dim)
        c.elem_bytes.update(F=12 * rows * self.dim, W=12 * rows * self.dim)
        return c


class VocabShard(Layer):
    """Share r of the token table (Vs, C) and of the head's weight (C, Vs) and bias (Vs); tied:
    the head's weight is the table's share, transposed (one matrix)."""

    def __init__(self, vocab, pp, rank, seq_len, width, *, tied, seed, num_blocks) -> None:
        super().__init__()
        self.vocab, self.pp, self.rank, self.seq_len, self.dim = vocab, pp, rank, seq_len, width
        self.share = share_size(vocab, pp)
        self.lo = rank * self.share
        self.real = max(0, min(vocab - self.lo, self.share))  # columns that are not padding
        self.tied, self.seed, self.num_blocks = tied, seed, num_blocks

    def __repr__(self) -> str:
        tied = ", tied" if self.tied else ""
        return f"VocabShard(rows {self.lo}..{self.lo + self.share} of {self.vocab}{tied})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"tokens": (self.share, self.dim)}
        if not self.tied:
            shapes["head"] = (self.dim, self.share)
        shapes["bias"] = (self.share,)
        return shapes

    def weight(self, grads: bool = False) -> np.ndarray:
        """The head's share (C, Vs), or its gradient."""
        d = self.grads if grads else self.params
        return d["tokens"].T if self.tied else d["head"]

    def init_params(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        # the unsplit model's draws (transformer.gpt_blocks), cut to this share
        hi = self.lo + self.real
        table = np.random.default_rng([self.seed, 0]).standard_normal((self.vocab, self.dim))
        params["tokens"][...] = 0.0
        params["tokens"][: self.real] = table[self.lo : hi] * 0.02
        params["bias"][...] = 0.0
        if not self.tied:
            head = np.random.default_rng([self.seed, self.num_blocks - 1])
            norm = LayerNorm(self.dim)
            norm.init_params({"weight": np.empty(self.dim), "bias": np.empty(self.dim)}, head)
            w = head.standard_normal((self.dim, self.vocab)) * 0.02
            params["head"][...] = 0.0
            params["head"][:, : self.real] = w[:, self.lo : hi]

    # ---- the embedding: forward and gradient by shares

    def _local(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = tokens.reshape(-1) - self.lo
        inside = (ids >= 0) & (ids < self.real)
        return ids, inside

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """(b, T) token ids -> (b, T, C): the share's rows where it holds the token, else 0."""
        ids, inside = self._local(tokens)
        out = self.params["tokens"].take(np.where(inside, ids, 0), axis=0)
        out[~inside] = 0.0
        return out.reshape(*tokens.shape, self.dim)

    def embed_grad(self, tokens: np.ndarray, dy: np.ndarray) -> None:
        """table_grad[t - lo] += dy[i] for the tokens in the share, in token order."""
        ids, inside = self._local(tokens)
        rows, ids = _rows(dy)[inside], ids[inside]
        table = self.grads["tokens"]
        if kernels.fast(rows, table):
            kernels.embedding_backward(ids, np.ascontiguousarray(rows), table)
        else:
            np.add.at(table, ids, rows)

    # ---- the head and the loss: partial logits, statistics, their gradient

    def logits(self, h: np.ndarray, targets: np.ndarray) -> tuple[tuple, np.ndarray]:
        """h (b, T, C) the final norm's output: exp(x - m_r) of the share's logits (the cache)
        and its statistics (STATS, N)."""
        x = _rows(h)
        z = x @ self.weight()
        z += self.params["bias"]
        if self.real < self.share:
            z[:, self.real :] = -np.inf  # padding: exp() = 0, never the argmax
        ids, inside = self._local(targets)
        rows = np.arange(z.shape[0])
        stats = np.zeros((STATS, z.shape[0]), np.float32)
        stats[0] = np.maximum(z.max(axis=1), LOWEST)  # a share of padding alone: finite
        stats[2] = np.where(inside, z[rows, np.where(inside, ids, 0)], 0.0)
        stats[3] = inside & (z.argmax(axis=1) == ids)
        z -= stats[0][:, None]
        np.exp(z, out=z)
        stats[1] = z.sum(axis=1)
        return (x, z, stats[0].copy(), ids, inside, h.shape), stats

    def head_backward(self, cache: tuple, total: np.ndarray, scale: float):
        """total: combine()'s (max, sum, target logit) over every share; scale: the loss's
        weight (1/M). Accumulates the share's weight gradient; returns (the mean loss, rows
        whose argmax is the target: counted by the share holding the global max, this share's
        part of dh (b, T, C))."""
        x, exps, own_max, ids, inside, shape = cache
        big_max, big_sum, target = total[0], total[1], total[2]
        n = x.shape[0]
        loss = float(np.mean(np.log(big_sum) - (target - big_max)))
        per_row = np.float32(scale / n)
        exps *= (np.exp(own_max - big_max) / big_sum * per_row)[:, None]  # the softmax, scaled
        rows = np.arange(n)[inside]
        exps[rows, ids[inside]] -= per_row
        # added inside the GEMM, as Linear's weight gradient (no (C, Vs) temporary)
        gemm.accumulate_xt_dy(self.weight(grads=True), x, exps)
        self.grads["bias"] += exps.sum(axis=0)
        dh = exps @ self.weight().T
        return loss, int(np.count_nonzero(total[3])), dh.reshape(*shape[:-1], self.dim)

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # S: x @ W_r (N, C, Vs), the exp; T: x^T dz (C, N, Vs) and dz W_r^T (N, Vs, C)
        c = self._base_cost(self.dim)
        c.gemms["F"].append((1, rows, self.dim, self.share))
        c.gemms["B"].append((1, rows, self.share, self.dim))
        c.gemms["W"].append((1, self.dim, rows, self.share))
        c.elem_bytes.update(F=16 * rows * self.share, B=12 * rows * self.share)
        # x^T dz added to the gradient inside the GEMM (nn/gemm; else a temporary, read and
        # written), as Linear's
        c.elem_bytes["W"] = 0 if gemm.available() else 12 * self.dim * self.share
        c.kept_bytes = 4 * rows * (self.share + self.dim)
        c.temporary_bytes = 4 * rows * self.share
        return c


def share_layer(cfg, seq_len: int, vocab: int, pp: int, rank: int, *, seed: int) -> VocabShard:
    """Rank `rank`'s share of the model `cfg` (model section) describes."""
    return VocabShard(vocab, pp, rank, seq_len, cfg.hidden, tied=cfg.tie_embeddings, seed=seed,
                      num_blocks=cfg.depth + 2)  # fmt: skip


def combine(stats: list[np.ndarray]) -> np.ndarray:
    """Every share's (STATS, N), in rank order -> (max M, sum S, target logit, hit of the share
    holding the first max): the same bits on every rank."""
    maxes = np.stack([s[0] for s in stats])
    big = maxes.max(axis=0)
    total = np.zeros((STATS, big.shape[0]), np.float32)
    total[0] = big
    for s in stats:
        total[1] += s[1] * np.exp(s[0] - big)
        total[2] += s[2]
    first = np.argmax(maxes == big, axis=0)  # ties: the lowest column, as argmax over all
    total[3] = np.stack([s[3] for s in stats])[first, np.arange(big.shape[0])]
    return total


def shard_tensors(shards: list[VocabShard], tied: bool) -> dict[str, np.ndarray]:
    """The whole table (V, C), head weight (C, V) and bias (V) from every share, in rank order
    (padding dropped): nanoGPT's names come from nn.weights."""
    vocab = shards[0].vocab
    table = np.concatenate([s.params["tokens"] for s in shards])[:vocab]
    bias = np.concatenate([s.params["bias"] for s in shards])[:vocab]
    head = table.T if tied else np.concatenate([s.params["head"] for s in shards], axis=1)
    return {"tokens": table, "head": np.ascontiguousarray(head[:, :vocab]), "bias": bias}


def head_flops(rows: int, width: int, vocab: int) -> int:
    """Training FLOPs of the unsplit head on `rows` rows: forward, input and weight gradient."""
    return 3 * 2 * rows * width * vocab
