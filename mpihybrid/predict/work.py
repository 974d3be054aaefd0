"""What a job's chunks compute per micro-batch, before any device is chosen: every GEMM's shape,
the bytes of the elementwise passes, the layer calls, the parameters and the activations kept.

    work = stage_work(job)        # one ChunkWork per model chunk (pp x virtual_stages)
    work[c].layers[i].gemms["W"]  # [(batch, m, k, n), ...] of top-level layer i's weight pass

Counted from the layers' code (layers.py, transformer.py, with the fused kernels of kernels.py),
per pass, for r rows of a micro-batch (samples, or samples x tokens), n = r x width elements:
    Linear(i, o)      F: x @ W, y += b (8 r o)   B: dy @ W^T (not the model's first layer)
                      W: x^T @ dy, grad += it (12 i o), bias: dy summed over rows (4 r o)
    ReLU              F: mask, x * mask (14 n)   B: dy * mask (9 n)
    GELU              F: read x, write y, t (12 n)   B: read dy, x, t, write dx (16 n)
    LayerNorm         F: 12 n   B: 12 n   W: 8 n
    CausalAttention   A = sequences x heads, T tokens, d = head width: F: q k^T, p v, softmax in
                      place (8 A T^2), heads back in place (8 n); B: dv, dp, dq, dk, softmax
                      backward (12 A T^2)
    Residual          F: h += x (12 n)   B: g += dy (12 n)
    Embedding         F: rows of the table + positions (20 n)   W: add.at of rows (24 n)
    loss (last chunk) F: softmax in place and argmax (12 r K)   B: scale in place (8 r K)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from mpihybrid.config import Job
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.layers import GELU, Layer, LayerNorm, Linear, ReLU
from mpihybrid.nn.model import Stage, boundary_shapes, build_blocks, chunk_ranges
from mpihybrid.nn.transformer import CausalAttention, Embedding, Residual

FLOAT = 4  # bytes of a float32
KINDS = ("F", "B", "W")
Gemm = tuple[int, int, int, int]  # `batch` products of (m, k) @ (k, n)


@dataclass
class LayerWork:
    """One top-level layer of a chunk (a Residual counts as one: the runtime reports weight
    gradients final per top-level layer) for one micro-batch."""

    params: int
    gemms: dict[str, list[Gemm]] = field(default_factory=lambda: {k: [] for k in KINDS})
    elem_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))


@dataclass
class ChunkWork:
    """One model chunk's work for one micro-batch."""

    layers: list[LayerWork]  # in the stage's order (its flat buffers' order)
    params: int
    activation_bytes: int  # what one micro-batch's forward keeps alive (the runtime's count)
    input_bytes: int  # the activation this chunk receives per micro-batch (0: chunk 0)
    largest_temporary: int  # bytes of the largest array a pass allocates and drops (workspace)

    def gemms(self, kind: str) -> list[Gemm]:
        return [g for layer in self.layers for g in layer.gemms[kind]]

    def flops(self, kind: str) -> float:
        return float(sum(2 * b * m * k * n for b, m, k, n in self.gemms(kind)))

    def elem_bytes(self, kind: str) -> float:
        return sum(layer.elem_bytes[kind] for layer in self.layers)

    def calls(self, kind: str) -> int:
        return sum(layer.calls[kind] for layer in self.layers)


def _leaf(work: LayerWork, layer: Layer, rows: int, width: int, first: bool) -> int:
    """Add one leaf layer's passes to `work` (`width`: its input's features); its output width."""
    g, e, c = work.gemms, work.elem_bytes, work.calls
    n = rows * width
    for kind in KINDS:
        c[kind] += 1 if kind != "W" or layer.param_shapes() else 0
    if isinstance(layer, Linear):
        i, o = layer.in_features, layer.out_features
        g["F"].append((1, rows, i, o))
        if not first:  # the model's first layer: no input gradient
            g["B"].append((1, rows, o, i))
        g["W"].append((1, i, rows, o))
        e["F"] += 8 * rows * o if layer.bias else 0
        e["W"] += 12 * i * o + (4 * rows * o if layer.bias else 0)
        return o
    if isinstance(layer, CausalAttention):
        t, d = layer.seq_len, layer.head_dim
        a = rows // t * layer.heads
        g["F"] += [(a, t, d, t), (a, t, t, d)]
        g["B"] += [(a, t, t, d), (a, t, d, t), (a, t, t, d), (a, t, t, d)]
        e["F"] += 8 * a * t * t + 8 * rows * layer.dim
        e["B"] += 12 * a * t * t
        return layer.dim
    if isinstance(layer, Embedding):
        n = rows * layer.dim
        e["F"] += 20 * n
        e["W"] += 24 * n
        return layer.dim
    per_element = {ReLU: (14, 9, 0), GELU: (12, 16, 0), LayerNorm: (12, 12, 8)}
    for cls, counts in per_element.items():
        if isinstance(layer, cls):
            for kind, count in zip(KINDS, counts, strict=True):
                e[kind] += count * n
    return width


def _layer(layer: Layer, rows: int, width: int, first: bool) -> tuple[LayerWork, int]:
    params = sum(math.prod(s) for s in layer.param_shapes().values())
    work = LayerWork(params)
    if isinstance(layer, Residual):
        inner = width
        for j, sub in enumerate(layer.branch):
            inner = _leaf(work, sub, rows, inner, first and j == 0)
        work.elem_bytes["F"] += 12 * rows * width
        work.elem_bytes["B"] += 12 * rows * width
        return work, width
    return work, _leaf(work, layer, rows, width, first)


def _largest_temporary(layers: list[Layer], rows: int, widths: list[int]) -> int:
    """The largest array one pass allocates and drops: a Linear's weight gradient before it is
    added to the buffer, or its output."""
    sizes = [0]
    for layer, width in zip(layers, widths, strict=True):
        for sub in layer.branch if isinstance(layer, Residual) else [layer]:
            if isinstance(sub, Linear):
                sizes += [sub.in_features * sub.out_features, rows * sub.out_features]
        sizes.append(rows * width)
    return FLOAT * max(sizes)


# ---------------------------------------------------------------------------------------------
# activations kept: probes of the runtime's own count


def _zero_bound(block: list[Layer]) -> None:
    """Give the block zero parameters (a probe: values do not change what a cache holds)."""
    for layer in block:
        shapes = layer.param_shapes()
        layer.bind(
            {k: np.zeros(s, np.float32) for k, s in shapes.items()},
            {k: np.zeros(s, np.float32) for k, s in shapes.items()},
        )


_PROBES: dict[tuple, tuple] = {}


def _probe_block(block: list[Layer], x: np.ndarray) -> tuple[int, int, int, np.ndarray]:
    """(bytes the block's forward keeps alive, of them its input's, of them its output's, its
    output) on input x, counted by the runtime's own rule (Stage.activation_nbytes)."""
    key = (repr(block), x.shape, x.dtype.str)
    if key not in _PROBES:
        _zero_bound(block)
        y, caches = x, []
        for layer in block:
            y, cache = layer.forward(y)
            caches.append(cache)
        count = Stage.activation_nbytes(None, caches)  # the method uses no state of its own
        input_kept = count + x.nbytes - Stage.activation_nbytes(None, [caches, x])
        output_kept = count + y.nbytes - Stage.activation_nbytes(None, [caches, y])
        _PROBES[key] = (count, input_kept, output_kept, y.shape, y.dtype.str)
    count, input_kept, output_kept, shape, dtype = _PROBES[key]
    return count, input_kept, output_kept, np.zeros(shape, dtype)


def _chunk_activations(blocks: list, ranges: list[range], x: np.ndarray) -> list[int]:
    """Bytes one micro-batch's forward keeps alive on each chunk, for the model input x."""
    out = []
    for chunk in ranges:
        act, previous_kept = 0, 0
        for g_index in chunk:
            count, input_kept, output_kept, x = _probe_block(blocks[g_index], x)
            # the array between two blocks counts once when both keep it
            act += count - (input_kept if previous_kept else 0)
            previous_kept = output_kept
        out.append(act)
    return out


def activation_bytes(job: Job, blocks: list, ranges: list[range], samples: int) -> list[int]:
    """Each chunk's activations per micro-batch of `samples`, from forwards of tiny probes: an
    MLP's caches grow linearly with rows (probes of 1 and 2 rows), a GPT's as a t + c t^2 with
    the tokens t of a sequence (probes of 4 and 8 tokens, the attention probabilities are
    t x t), and linearly with sequences."""
    in_features = task_dims(job.data)[0]
    if job.model.kind == "gpt":
        b4, b8 = (_chunk_activations(blocks, ranges, np.zeros((1, t), np.int64)) for t in (4, 8))
        t = in_features
        return [
            samples * round((y4 - 16 * (y8 - 2 * y4) / 32) / 4 * t + (y8 - 2 * y4) / 32 * t * t)
            for y4, y8 in zip(b4, b8, strict=True)
        ]
    b1, b2 = (
        _chunk_activations(blocks, ranges, np.zeros((n, in_features), np.float32)) for n in (1, 2)
    )
    return [(y1 - (y2 - y1)) + samples * (y2 - y1) for y1, y2 in zip(b1, b2, strict=True)]


# ---------------------------------------------------------------------------------------------


def microbatch_rows(job: Job) -> tuple[int, int]:
    """(samples, rows) of one micro-batch: rows are samples x tokens for a GPT."""
    g, t = job.grid, job.train
    samples = t.global_batch // (g.dp * t.microbatches)
    return samples, samples * (job.data.seq_len if job.model.kind == "gpt" else 1)


def stage_work(job: Job) -> list[ChunkWork]:
    """Every chunk's work per micro-batch of `job` (pp x virtual_stages chunks)."""
    m = job.model
    in_features, num_classes = task_dims(job.data)
    blocks = build_blocks(m, in_features, num_classes)
    num_chunks = job.grid.pp * job.train.virtual_stages
    samples, rows = microbatch_rows(job)
    shapes = boundary_shapes(m, in_features, num_classes, num_chunks, samples)
    ranges = chunk_ranges(m, blocks, num_chunks)
    acts = activation_bytes(job, blocks, ranges, samples)
    width = 0 if m.kind == "gpt" else in_features  # a GPT's first layer takes token ids
    out = []
    for c, chunk in enumerate(ranges):
        layers, widths = [], []
        for g_index in chunk:
            for i, layer in enumerate(blocks[g_index]):
                widths.append(width)
                work, width = _layer(layer, rows, width, g_index == 0 and i == 0)
                layers.append(work)
        top = [layer for g_index in chunk for layer in blocks[g_index]]
        temporary = _largest_temporary(top, rows, widths)
        if c == num_chunks - 1:  # the loss: softmax over the logits, forward and backward
            layers[-1].elem_bytes["F"] += 3 * FLOAT * rows * num_classes
            layers[-1].elem_bytes["B"] += 2 * FLOAT * rows * num_classes
            temporary = max(temporary, FLOAT * rows * num_classes)
        input_bytes = FLOAT * math.prod(shapes[c]) if c else 0
        params = sum(layer.params for layer in layers)
        out.append(ChunkWork(layers, params, acts[c], input_bytes, temporary))
    return out
