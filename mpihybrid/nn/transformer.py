"""The pieces of a GPT that layers.py lacks: embeddings, causal attention, residual blocks.

A pre-norm transformer layer is two residual branches, each a plain list of layers:

    x = x + Linear(C, C)(CausalAttention(h)(Linear(C, 3C)(LayerNorm(x))))
    x = x + Linear(F, C)(GELU(Linear(C, F)(LayerNorm(x))))

so the attention core itself has no parameters and every weight gradient comes from a
Linear or a LayerNorm, whose backward already splits into input and weight halves
(zero-bubble schedules run the halves at different times). `Embedding` turns integer
tokens (b, T) into (b, T, C); it has no input gradient, only weight gradients.

Shapes: b = sequences in a micro-batch, T = tokens per sequence, C = width, h = heads,
d = C / h, V = vocabulary, F = feed-forward width.
"""

from __future__ import annotations

import math

import numpy as np

from mpihybrid.comm.device import array_module
from mpihybrid.nn import kernels
from mpihybrid.nn.gelu import GELUErf
from mpihybrid.nn.layers import FLOAT, GELU, Cost, Layer, LayerNorm, Linear, layer_costs
from mpihybrid.nn.settings import Setting
from mpihybrid.nn.vocab import Positions

GPT_INIT_STD = 0.02  # GPT-2's initialisation of embeddings and linear weights

# model.* keys a GPT reads beyond every kind's (nn/settings.py); hidden: the width C, depth: its
# transformer layers
HEADS = Setting("heads", 4, "attention heads (model.hidden must divide by it)", low=1)
TIE_EMBEDDINGS = Setting("tie_embeddings", False, "the head's weight is the token table")
GPT_SETTINGS = (
    HEADS,
    Setting("ffn", 0, "the feed-forward width, 0 = 4 x hidden", low=0),
    TIE_EMBEDDINGS,  # nanoGPT's wte = lm_head
    Setting("vocab_parallel", False, "table and head split by vocabulary over the pp ranks"),
    Setting("gelu", "tanh", "GELU's form: tanh (GPT-2's) | erf (nanoGPT's)", ("tanh", "erf")),
)


class Embedding(Layer):
    """y[b, t] = token_table[tokens[b, t]] + position_table[t]."""

    def __init__(self, vocab: int, seq_len: int, dim: int) -> None:
        super().__init__()
        self.vocab, self.seq_len, self.dim = vocab, seq_len, dim

    def __repr__(self) -> str:
        return f"Embedding(vocab={self.vocab}, seq_len={self.seq_len}, dim={self.dim})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"tokens": (self.vocab, self.dim), "positions": (self.seq_len, self.dim)}

    def init_params(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        for name in ("tokens", "positions"):
            params[name][...] = rng.standard_normal(params[name].shape) * GPT_INIT_STD

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        tokens = x
        y = self.params["tokens"].take(tokens, axis=0)  # (b, T, C), a fresh array
        y += self.params["positions"][: tokens.shape[-1]]
        return y, tokens

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        return None, (cache, dy)  # integer tokens have no gradient

    def backward_weight(self, wcache: object) -> None:
        tokens, dy = wcache
        self.add_token_rows(tokens, dy)
        self.grads["positions"][: tokens.shape[-1]] += dy.reshape(-1, *dy.shape[-2:]).sum(axis=0)

    def add_token_rows(self, tokens: np.ndarray, dy: np.ndarray) -> None:
        """The token table's gradient: each token's row of dy added to its row (repeats add)."""
        rows, ids = dy.reshape(-1, self.dim), tokens.reshape(-1)
        table = self.grads["tokens"]
        if kernels.fast(rows, table) and type(ids) is np.ndarray:
            kernels.embedding_backward(ids, rows, table)
        else:  # numpy's add.at, or a device's scatter-add: the same order, the same bits
            array_module(dy).add.at(table, ids, rows)

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # rows = tokens. F: gather the rows of the table, add the positions (20 a value);
        # W: add.at of the rows (24).  Keeps the int64 tokens.
        n = rows * self.dim
        c = self._base_cost(self.dim)
        c.elem_bytes.update(F=20 * n, W=24 * n)
        c.kept_bytes = 8 * rows
        c.temporary_bytes = FLOAT * n
        return c


class CausalAttention(Layer):
    """Multi-head causal self-attention on packed projections: (b, T, 3C) -> (b, T, C).

    No parameters: the q/k/v projection before it and the output projection after it are
    ordinary Linear layers.
    """

    def __init__(self, dim: int, heads: int, seq_len: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by heads {heads}")
        self.dim, self.heads, self.seq_len = dim, heads, seq_len
        self.head_dim = dim // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self._masks: dict[tuple, object] = {}  # (array module, dtype) -> causal mask

    def _mask(self, like, t: int):
        """(T, T) added to the scores: -inf above the diagonal, so position t sees only 0..t."""
        xp = array_module(like)
        key = (xp.__name__, like.dtype)
        if key not in self._masks:
            full = np.full((self.seq_len, self.seq_len), -np.inf, like.dtype)
            self._masks[key] = xp.asarray(np.triu(full, k=1))
        return self._masks[key][:t, :t]

    def __repr__(self) -> str:
        return f"CausalAttention(dim={self.dim}, heads={self.heads}, seq_len={self.seq_len})"

    def _split(self, qkv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b, t = qkv.shape[0], qkv.shape[1]
        # views, no copies: (b, T, 3, h, d) -> (3, b, h, T, d)
        parts = qkv.reshape(b, t, 3, self.heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        return parts[0], parts[1], parts[2]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        t = x.shape[1]
        q, k, v = self._split(x)
        scores = q @ k.transpose(0, 1, 3, 2)  # (b, h, T, T)
        if kernels.fast(scores):  # scale, mask and softmax in one pass, in place
            kernels.softmax_causal_forward(
                scores.reshape(-1, t, t), np.float32(self.scale), np.empty(t, np.int32)
            )
            return self._forward_out(scores, v, x)
        scores *= x.dtype.type(self.scale)
        scores += self._mask(x, t)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores, out=scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        return self._forward_out(probs, v, x)

    def _forward_out(self, probs: np.ndarray, v: np.ndarray, x: np.ndarray):
        b, t = x.shape[0], x.shape[1]
        out = probs @ v  # (b, h, T, d)
        y = array_module(x).ascontiguousarray(out.transpose(0, 2, 1, 3)).reshape(b, t, self.dim)
        return y, (x, probs)

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        x, probs = cache
        b, t = x.shape[0], x.shape[1]
        q, k, v = self._split(x)
        dout = dy.reshape(b, t, self.heads, self.head_dim).transpose(0, 2, 1, 3)  # (b, h, T, d)
        dx = array_module(dy).empty((b, t, 3, self.heads, self.head_dim), dy.dtype)
        dparts = dx.transpose(2, 0, 3, 1, 4)  # (3, b, h, T, d) views into dx
        _matmul_into(probs.transpose(0, 1, 3, 2), dout, dparts[2])  # dv
        dprobs = dout @ v.transpose(0, 1, 3, 2)  # (b, h, T, T)
        if kernels.fast(dprobs, probs):
            kernels.softmax_causal_backward(
                dprobs.reshape(-1, t, t), probs.reshape(-1, t, t), np.float32(self.scale)
            )
            return self._backward_qk(dprobs, q, k, dparts, dx)
        # softmax backward: ds = p * (dp - sum_j dp_j p_j); the masked entries have p = 0
        dprobs -= np.einsum("bhij,bhij->bhi", dprobs, probs)[..., None]
        dscores = np.multiply(dprobs, probs, out=dprobs)
        dscores *= dy.dtype.type(self.scale)
        return self._backward_qk(dscores, q, k, dparts, dx)

    def _backward_qk(self, dscores, q, k, dparts, dx) -> tuple[np.ndarray, None]:
        _matmul_into(dscores, k, dparts[0])  # dq
        _matmul_into(dscores.transpose(0, 1, 3, 2), q, dparts[1])  # dk
        return dx.reshape(*dx.shape[:2], 3 * self.dim), None

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # A = sequences x heads products of T x d.  F: q k^T, p v; the softmax in place (8 a
        # score), the heads back in place (8 a value).  B: dv, dp, dq, dk; the softmax's
        # backward (12 a score).  Keeps x (b, T, 3C) and the probabilities (A, T, T).
        t, d = self.seq_len, self.head_dim
        a = rows // t * self.heads
        c = self._base_cost(self.dim)
        c.gemms["F"] += [(a, t, d, t), (a, t, t, d)]
        c.gemms["B"] += [(a, t, t, d), (a, t, d, t), (a, t, t, d), (a, t, t, d)]
        c.elem_bytes.update(F=8 * a * t * t + 8 * rows * self.dim, B=12 * a * t * t)
        c.kept_bytes = FLOAT * (rows * 3 * self.dim + a * t * t)
        c.temporary_bytes = FLOAT * max(rows * 3 * self.dim, a * t * t)  # dx; dprobs
        return c

    def flops(self, batch: int) -> int:
        # per row (token) of one sequence's declared forward: q k^T and probs v over the full
        # T x T square (the causal half is masked, not skipped)
        return batch * self.cost(self.seq_len, 3 * self.dim).flops("F") // self.seq_len


def _matmul_into(a, b, out) -> None:
    """out[...] = a @ b; numpy writes straight into the strided view, CuPy's matmul is given
    no strided `out` (it asks for a contiguous one) and its result is copied in."""
    if array_module(out) is np:
        np.matmul(a, b, out=out)
    else:
        out[...] = a @ b


class Residual(Layer):
    """y = x + branch(x), the branch a list of layers whose parameters this layer exposes."""

    def __init__(self, branch: list[Layer]) -> None:
        super().__init__()
        self.branch = branch
        # a Linear then a GELU: the GELU's kernel adds the Linear's bias (one pass, not two)
        for before, after in zip(branch, branch[1:], strict=False):
            if isinstance(before, Linear) and before.bias and isinstance(after, GELU):
                before.bias_to_next, after.bias_from = True, before

    def __repr__(self) -> str:
        return f"Residual({', '.join(map(repr, self.branch))})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            f"{i}.{name}": shape
            for i, layer in enumerate(self.branch)
            for name, shape in layer.param_shapes().items()
        }

    def _split(self, arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        parts: list[dict[str, np.ndarray]] = [{} for _ in self.branch]
        for key, array in arrays.items():
            i, name = key.split(".", 1)
            parts[int(i)][name] = array
        return parts

    def bind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        super().bind(params, grads)
        for layer, p, g in zip(self.branch, self._split(params), self._split(grads), strict=True):
            layer.bind(p, g)

    def init_params(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        for layer, p in zip(self.branch, self._split(params), strict=True):
            layer.init_params(p, rng)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        h, caches = x, []
        for layer in self.branch[:-1]:
            h, cache = layer.forward(h)
            caches.append(cache)
        last = self.branch[-1]
        if isinstance(last, Linear):  # its bias and the skip in one pass
            h, cache = last.forward(h, skip=x)
        else:
            # the branch ends in a layer whose output nobody else holds: add the skip in place
            h, cache = last.forward(h)
            h += x
        caches.append(cache)
        return h, caches

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        g, wcaches = dy, []
        for layer, c in zip(reversed(self.branch), reversed(cache), strict=True):
            g, wc = layer.backward_input(g, c, True)
            wcaches.append(wc)
        g += dy  # the branch's first layer returned a fresh array
        return g, wcaches[::-1]

    def backward_weight(self, wcache: object) -> None:
        for layer, wc in zip(self.branch, wcache, strict=True):
            layer.backward_weight(wc)

    def backward_weight_merged(self, wcaches: list[object]) -> None:
        """Each branch layer merges its own part of every micro-batch's wcache."""
        for i, layer in enumerate(self.branch):
            layer.backward_weight_merged([wc[i] for wc in wcaches])

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # the branch's, and the skip: h += x (F), g += dy (B), 12 a value each
        c = self._base_cost(width)
        c.calls = dict.fromkeys(c.calls, 0)
        for sub in layer_costs(self.branch, rows, width, need_dx):
            c.add(sub)
        c.elem_bytes["F"] += 12 * rows * width
        c.elem_bytes["B"] += 12 * rows * width
        c.temporary_bytes = max(c.temporary_bytes, FLOAT * rows * width)
        return c

    def flops(self, batch: int) -> int:
        return sum(layer.flops(batch) for layer in self.branch)


def gpt_blocks(cfg, seq_len: int, vocab: int, *, tied: bool = False) -> list[list[Layer]]:
    """[Embedding], `depth` pre-norm transformer layers, [LayerNorm, LM head].

    `cfg` needs: hidden (width C), depth (layers), heads, ffn (0 = 4 C), vocab_parallel (table
    and head left to nn/vocab.py) and gelu (tanh | erf). Linear weights are
    drawn from N(0, 0.02^2), the residual projections' scaled by 1/sqrt(2 depth) (GPT-2).
    Its entry in the registry of model kinds is `kinds.GPT`.
    """
    width, ffn = cfg.hidden, cfg.ffn or 4 * cfg.hidden
    if cfg.depth < 1:
        raise ValueError(f"model.depth = {cfg.depth}: need at least 1 transformer layer")
    if width % cfg.heads:
        raise ValueError(f"model.hidden({width}) is not divisible by model.heads({cfg.heads})")
    out_std = GPT_INIT_STD / math.sqrt(2 * cfg.depth)
    # model.vocab_parallel: the token table and the head are shared out by vocabulary over the
    # pp ranks (nn/vocab.py); the stages keep the position table and the final norm
    vocab_parallel = cfg.vocab_parallel
    first = Positions(vocab, seq_len, width) if vocab_parallel else Embedding(vocab, seq_len, width)
    blocks: list[list[Layer]] = [[first]]
    for _ in range(cfg.depth):
        attention = Residual(
            [
                LayerNorm(width),
                Linear(width, 3 * width, init_std=GPT_INIT_STD),
                CausalAttention(width, cfg.heads, seq_len),
                Linear(width, width, init_std=out_std),
            ]
        )
        mlp = Residual(
            [
                LayerNorm(width),
                Linear(width, ffn, init_std=GPT_INIT_STD),
                GELU() if cfg.gelu == "tanh" else GELUErf(),
                Linear(ffn, width, init_std=out_std),
            ]
        )
        blocks.append([attention, mlp])
    # tied (model.tie_embeddings, the kind says: ModelKind.build): the head's weight is the
    # token table's, transposed
    head = Linear(width, vocab, init_std=GPT_INIT_STD, tied=tied)
    blocks.append([LayerNorm(width)] if vocab_parallel else [LayerNorm(width), head])
    return blocks
