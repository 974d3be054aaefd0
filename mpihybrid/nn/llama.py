"""The pieces of a Llama that transformer.py lacks: RMSNorm, SwiGLU, rotary attention with
grouped-query heads, and the token table without positions. Built by `llama_blocks`, the
registry's `kinds.LLAMA` (model.kind = "llama"; its weights file: llama_weights.py). A layer
is two residual branches:

    x = x + Linear(C, C)(RotaryAttention(h, g)(Linear(C, (h + 2g) d)(RMSNorm(x))))
    x = x + Linear(F, C)(SwiGLU(Linear(C, 2F)(RMSNorm(x))))

no Linear has a bias. RotaryAttention rotates q and k by their position (RoPE, Hugging Face's
half-split convention: the first d/2 features pair with the last d/2), repeats each of the g
key/value heads for h / g query heads, and runs the GPT's CausalAttention on the result; its
backward sums the repeated heads' gradients and rotates back. SwiGLU's input is the gate
projection's F features and the up projection's F, side by side.

Shapes: b = sequences in a micro-batch, T = tokens per sequence, C = width, h = heads,
g = key/value heads, d = C / h, V = vocabulary, F = feed-forward width.
"""

from __future__ import annotations

import math

import numpy as np

from mpihybrid.comm.device import array_module
from mpihybrid.nn import kernels
from mpihybrid.nn.layers import FLOAT, Cost, Layer, Linear, norm_dx_kernel
from mpihybrid.nn.settings import Setting
from mpihybrid.nn.transformer import (
    GPT_INIT_STD,
    HEADS,
    TIE_EMBEDDINGS,
    CausalAttention,
    Embedding,
    Residual,
)

ROPE_THETA = 10000.0  # Llama's base of the rotary frequencies
RMS_EPS = 1e-5  # Llama 2's

# model.* keys a llama reads beyond every kind's (nn/settings.py); hidden: the width C, depth:
# its transformer layers
LLAMA_SETTINGS = (
    HEADS,
    Setting("kv_heads", 0, "key/value heads (grouped-query attention); 0 = heads", low=0),
    Setting("ffn", 0, "the SwiGLU's width, 0 = ceil(8/3 x hidden)", low=0),
    TIE_EMBEDDINGS,  # Hugging Face's tie_word_embeddings
)


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1])


class TokenEmbedding(Embedding):
    """y[b, t] = token_table[tokens[b, t]]: no position table (the attention rotates by it)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__(vocab, 0, dim)

    def __repr__(self) -> str:
        return f"TokenEmbedding(vocab={self.vocab}, dim={self.dim})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"tokens": (self.vocab, self.dim)}

    def init_params(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        params["tokens"][...] = rng.standard_normal(params["tokens"].shape) * GPT_INIT_STD

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        return self.params["tokens"].take(x, axis=0), x

    def backward_weight(self, wcache: object) -> None:
        self.add_token_rows(*wcache)  # no position table to add to

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # F: gather the rows of the table (8 a value); W: add.at of the rows (24)
        c = super().cost(rows, width, need_dx)
        c.elem_bytes["F"] = 8 * rows * self.dim
        return c


class RMSNorm(Layer):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension (no mean, no bias)."""

    def __init__(self, dim: int, eps: float = RMS_EPS) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def __repr__(self) -> str:
        return f"RMSNorm({self.dim}, eps={self.eps})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.dim,)}

    def init_params(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        params["weight"][...] = 1.0

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        w = self.params["weight"]
        if kernels.fast(x, w):  # one pass (nn/kernels.py); the numpy below is the reference
            y, xhat = np.empty_like(x), np.empty_like(x)
            rstd = np.empty((*x.shape[:-1], 1), np.float32)
            kernels.rmsnorm_forward(_rows(x), w, np.float32(self.eps), _rows(y), _rows(xhat),
                                    rstd.reshape(-1))  # fmt: skip
            return y, (xhat, rstd)
        f = x.dtype.type
        ms = np.einsum("...c,...c->...", x, x)[..., None]  # no (..., C) temporary
        ms *= f(1.0 / self.dim)
        ms += f(self.eps)
        rstd = np.sqrt(ms, out=ms)
        np.divide(f(1.0), rstd, out=rstd)
        xhat = x * rstd
        return xhat * self.params["weight"].astype(x.dtype, copy=False), (xhat, rstd)

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        xhat, rstd = cache
        w = self.params["weight"]
        dx = norm_dx_kernel(kernels.rmsnorm_backward_input, dy, cache, w)
        if dx is not None:
            return dx, (xhat, dy)
        dxhat = dy * w.astype(dy.dtype, copy=False)
        # d/dx of x * rstd, rstd depending on x: rstd (dxhat - xhat mean(dxhat xhat))
        dx = xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True)
        np.subtract(dxhat, dx, out=dx)
        dx *= rstd
        return dx, (xhat, dy)

    def backward_weight(self, wcache: object) -> None:
        xhat, dy = wcache
        dw = self.grads["weight"]
        if kernels.fast(dy, xhat, dw):
            kernels.rmsnorm_backward_weight(_rows(dy), _rows(xhat), dw)
            return
        dw += np.einsum("bc,bc->c", _rows(dy), _rows(xhat))
        # a merged W keeps Layer's loop, serial's bits: gathering first for one kernel call is
        # slower (240 wide, 4 micro-batches of 64 rows: 15 us against 12; of 128: 36 against 23)

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # F reads x, writes xhat and y (12);  B reads dy, xhat, writes dxhat and dx (16);  W
        # reads dy and xhat (8).  Keeps xhat and one rstd per row.
        n = rows * self.dim
        c = self._base_cost(self.dim)
        c.elem_bytes.update(F=12 * n, B=16 * n, W=8 * n)
        c.kept_bytes = FLOAT * (n + rows)
        c.temporary_bytes = 2 * FLOAT * n
        return c


class SwiGLU(Layer):
    """(..., 2F) -> (..., F): silu(gate) * up, gate the first F features, up the last F."""

    def __repr__(self) -> str:
        return "SwiGLU()"

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        f, half = x.shape[-1] // 2, x.dtype.type(0.5)
        if kernels.fast(x):  # one pass (nn/kernels.py); the numpy below is the reference
            y, sig = (
                np.empty((*x.shape[:-1], f), np.float32),
                np.empty((*x.shape[:-1], f), np.float32),
            )
            kernels.swiglu_forward(_rows(x), _rows(y), _rows(sig))
            return y, (x, sig)
        gate, up = x[..., :f], x[..., f:]
        # sigmoid(a) = (1 + tanh(a / 2)) / 2: no exp to overflow at large |a|
        sig = np.multiply(gate, half)
        np.tanh(sig, out=sig)
        sig *= half
        sig += half
        y = gate * sig
        y *= up
        return y, (x, sig)

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        # silu'(a) = s (1 + a (1 - s)), s = sigmoid(a):  dgate = dy up silu'(gate), dup = dy silu
        x, sig = cache
        f = sig.shape[-1]
        dx = array_module(dy).empty_like(x)
        if kernels.fast(dy, x, sig):
            kernels.swiglu_backward(_rows(dy), _rows(x), _rows(sig), _rows(dx))
            return dx, None
        gate, up = x[..., :f], x[..., f:]
        dgate, dup = dx[..., :f], dx[..., f:]
        np.multiply(gate, sig, out=dup)
        dup *= dy  # dup = dy silu(gate)
        one = dy.dtype.type(1.0)
        np.subtract(one, sig, out=dgate)
        dgate *= gate
        dgate += one
        dgate *= sig
        dgate *= up
        dgate *= dy
        return dx, None

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # n = rows x F.  F: the sigmoid (4 passes over n, 32) and y (3 passes, 28);  B: dup
        # (2 passes, 24) and dgate (6 passes, 60).  Keeps x (2n) and the sigmoid (n).
        n = rows * width // 2
        c = self._base_cost(width // 2)
        c.elem_bytes.update(F=60 * n, B=84 * n)
        c.kept_bytes = 3 * FLOAT * n
        c.temporary_bytes = 2 * FLOAT * n
        return c


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, d: int, out: np.ndarray) -> None:
    """out = x with each head's feature pair (i, i + d/2) turned by its angle: x cos + (x2, x1)
    sin, x and out (b, T, n d), cos and sin (T, n d) holding [cos, cos] and [-sin, sin] per head
    (negated sin turns back). Whole rows at a time: operations on the halves would loop over
    d/2-float pieces, several times slower at these widths."""
    b, t, width = x.shape
    swapped = array_module(x).empty((b, t, width // d, 2, d // 2), x.dtype)
    swapped[...] = x.reshape(swapped.shape)[:, :, :, ::-1]  # (x1, x2) -> (x2, x1)
    swapped = swapped.reshape(b, t, width)
    swapped *= sin
    np.multiply(x, cos, out=out)
    out += swapped


class RotaryAttention(Layer):
    """Causal self-attention with RoPE and grouped-query heads: (b, T, (h + 2g) d) -> (b, T, C).

    No parameters: the q/k/v projection before it and the output projection after it are
    Linear layers. The attention itself is CausalAttention's (its cost, its kernels).
    """

    def __init__(self, dim: int, heads: int, kv_heads: int, seq_len: int) -> None:
        super().__init__()
        if problem := _head_problem(dim, heads, kv_heads):
            raise ValueError(problem)
        self.dim, self.heads, self.kv_heads, self.seq_len = dim, heads, kv_heads, seq_len
        self.head_dim = dim // heads
        self.core = CausalAttention(dim, heads, seq_len)
        self._angles: dict[tuple, tuple] = {}  # (module, dtype, heads) -> (cos, sin, -sin)

    def __repr__(self) -> str:
        return f"RotaryAttention(dim={self.dim}, heads={self.heads}, kv_heads={self.kv_heads})"

    def _cos_sin(self, like, t: int, heads: int):
        """cos, sin and -sin tables of position x frequency for `heads` heads side by side,
        (T, heads d) as _rotate takes them, in like's dtype and array module."""
        xp = array_module(like)
        key = (xp.__name__, like.dtype, heads)
        if key not in self._angles:
            half = self.head_dim // 2
            freqs = ROPE_THETA ** (-np.arange(half) * 2.0 / self.head_dim)
            angle = np.outer(np.arange(self.seq_len), freqs)
            cos, sin = np.cos(angle), np.sin(angle)
            tables = (np.hstack([cos, cos]), np.hstack([-sin, sin]))
            tables = tuple(np.tile(a, heads) for a in (*tables, -tables[1]))
            self._angles[key] = tuple(xp.asarray(a.astype(like.dtype)) for a in tables)
        return tuple(a[:t] for a in self._angles[key])

    def _views(self, x: np.ndarray):
        """q (b, T, h d), k and v (b, T, g d): views of the packed projections."""
        kv = self.kv_heads * self.head_dim
        return x[..., : self.dim], x[..., self.dim : self.dim + kv], x[..., self.dim + kv :]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        return self.core.forward(self.pack(x).reshape(x.shape[0], x.shape[1], 3 * self.dim))

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        dpacked, _ = self.core.backward_input(dy, cache)
        return self.unpack(dpacked), None

    def pack(self, x: np.ndarray) -> np.ndarray:
        """The core's packed (b, T, 3, h, d) from x: q and k rotated, h split into (g, r) with
        query head i reading kv head i // r."""
        b, t = x.shape[0], x.shape[1]
        g, r, d = self.kv_heads, self.heads // self.kv_heads, self.head_dim
        packed = array_module(x).empty((b, t, 3, g, r, d), x.dtype)
        if kernels.fast(x):  # one pass (nn/kernels.py); the numpy below is the reference
            kernels.rotary_pack(x, *self._cos_sin(x, t, 1)[:2], packed)
            return packed
        q, k, v = self._views(x)
        cos, sin, _ = self._cos_sin(x, t, self.heads)
        _rotate(q, cos, sin, d, packed[:, :, 0].reshape(b, t, self.dim))
        cos, sin, _ = self._cos_sin(x, t, g)
        rotated_k = array_module(x).empty_like(k)
        _rotate(k, cos, sin, d, rotated_k)
        packed[:, :, 1] = rotated_k.reshape(b, t, g, 1, d)
        packed[:, :, 2] = v.reshape(b, t, g, 1, d)
        return packed

    def unpack(self, dpacked: np.ndarray) -> np.ndarray:
        """pack's backward: dx (b, T, (h + 2g) d) from the core's (b, T, 3C) input gradient."""
        b, t = dpacked.shape[0], dpacked.shape[1]
        g, r, d = self.kv_heads, self.heads // self.kv_heads, self.head_dim
        dpacked = dpacked.reshape(b, t, 3, g, r, d)
        dx = array_module(dpacked).empty((b, t, self.dim + 2 * g * d), dpacked.dtype)
        if kernels.fast(dpacked):
            cos, _, minus_sin = self._cos_sin(dpacked, t, 1)
            kernels.rotary_unpack(dpacked, cos, minus_sin, dx)
            return dx
        dq, dk, dv = self._views(dx)
        cos, _, minus_sin = self._cos_sin(dpacked, t, self.heads)
        _rotate(dpacked[:, :, 0].reshape(b, t, self.dim), cos, minus_sin, d, dq)
        cos, _, minus_sin = self._cos_sin(dpacked, t, g)
        summed = dpacked[:, :, 1].sum(axis=3).reshape(b, t, g * d)  # the repeated heads add up
        _rotate(summed, cos, minus_sin, d, dk)
        dpacked[:, :, 2].sum(axis=3, out=dv.reshape(b, t, g, d))
        return dx

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # CausalAttention's on h heads, and: F rotates q and k (reads x, cos, sin, writes: 16 a
        # value) and fills the packed heads (8 a value of 3C); B sums the repeated heads (8 a
        # value of 3C) and rotates back (16).  The packed heads are its input, kept.
        c = self.core.cost(rows, 3 * self.dim, need_dx)
        rotated = rows * (self.heads + self.kv_heads) * self.head_dim
        c.elem_bytes["F"] += 16 * rotated + 8 * rows * 3 * self.dim
        c.elem_bytes["B"] += 16 * rotated + 8 * rows * 3 * self.dim
        c.temporary_bytes = max(c.temporary_bytes, FLOAT * rows * 3 * self.dim)
        return c

    def flops(self, batch: int) -> int:
        return self.core.flops(batch)


def _head_problem(dim: int, heads: int, kv_heads: int) -> str:
    if dim % heads:
        return f"model.hidden({dim}) is not divisible by model.heads({heads})"
    if kv_heads < 1 or heads % kv_heads:
        return f"model.kv_heads({kv_heads}) does not divide model.heads({heads})"
    if (dim // heads) % 2:
        return (
            f"model.hidden({dim}) / model.heads({heads}) = {dim // heads}: the head width "
            "must be even (the rotary embedding turns pairs of features)"
        )
    return ""


def llama_check(cfg) -> str:
    """What is wrong with a llama's model section beyond each setting's own check, in one line
    ("" = nothing)."""
    return _head_problem(cfg.hidden, cfg.heads, cfg.kv_heads or cfg.heads)


def ffn_width(cfg) -> int:
    """model.ffn, or Llama's 8/3 C (the SwiGLU's three matrices cost a GELU MLP's two of 4 C)."""
    return cfg.ffn or math.ceil(8 * cfg.hidden / 3)


def llama_blocks(cfg, seq_len: int, vocab: int, *, tied: bool = False) -> list[list[Layer]]:
    """[TokenEmbedding], `depth` pre-norm Llama layers, [RMSNorm, LM head].

    `cfg` needs: hidden (C), depth, heads, kv_heads (0 = heads), ffn (0 = 8/3 C); tied: the
    head's weight is the token table's (ModelKind.build says). Weights are drawn as the GPT's:
    N(0, 0.02^2), the residual projections' scaled by 1/sqrt(2 depth).
    """
    if cfg.depth < 1:
        raise ValueError(f"model.depth = {cfg.depth}: need at least 1 transformer layer")
    if problem := llama_check(cfg):
        raise ValueError(problem)
    width, ffn, heads = cfg.hidden, ffn_width(cfg), cfg.heads
    kv_heads = cfg.kv_heads or heads
    qkv = width + 2 * kv_heads * (width // heads)
    out_std = GPT_INIT_STD / math.sqrt(2 * cfg.depth)
    blocks: list[list[Layer]] = [[TokenEmbedding(vocab, width)]]
    for _ in range(cfg.depth):
        attention = Residual(
            [
                RMSNorm(width),
                Linear(width, qkv, bias=False, init_std=GPT_INIT_STD),
                RotaryAttention(width, heads, kv_heads, seq_len),
                Linear(width, width, bias=False, init_std=out_std),
            ]
        )
        mlp = Residual(
            [
                RMSNorm(width),
                Linear(width, 2 * ffn, bias=False, init_std=GPT_INIT_STD),  # gate, up
                SwiGLU(),
                Linear(ffn, width, bias=False, init_std=out_std),
            ]
        )
        blocks.append([attention, mlp])
    head = Linear(width, vocab, bias=False, init_std=GPT_INIT_STD, tied=tied)
    blocks.append([RMSNorm(width), head])
    return blocks
