"""Models as lists of blocks, partitioned into contiguous stages with flat buffers.

A block is the unit of partitioning:
    mlp  one hidden Linear with its norm and activation; the classifier head
    gpt  the token + position embedding; one transformer layer; final LayerNorm + LM head
`model.partition` says how the blocks are split into chunks: "cost" balances estimated
training FLOPs (forward + backward), "uniform" deals out the hidden blocks / transformer
layers evenly, a list gives the count per chunk (the GPT's embedding goes with the first
chunk and its head with the last). A `Stage` owns one chunk and keeps all its parameters
in ONE flat buffer (and its gradients in another with the same layout), so the all-reduce,
the optimizer and checkpoints each see a single contiguous array.

The model's input is described by two numbers: `in_features` (mlp: features per sample;
gpt: tokens per sequence) and `num_classes` (mlp: classes; gpt: vocabulary size).

Block g is initialised from `np.random.default_rng([seed, g])` whatever stage it lands
in, so any split of the model holds exactly the parameters of the unsplit model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.layers import Layer

GradHook = Callable[[int], None]  # on_grad(lo): every gradient at flat offsets >= lo is written

# B = rows of a micro-batch, C = features, K = classes; gpt: T = tokens per sequence

Block = list[Layer]


def build_blocks(cfg, in_features: int, num_classes: int) -> list[Block]:
    """The model's blocks in order, as its kind (`cfg.kind`, nn/kinds.py) builds them."""
    return model_kind(cfg.kind).build(cfg, in_features, num_classes)


def block_num_params(block: Block) -> int:
    return sum(math.prod(s) for layer in block for s in layer.param_shapes().values())


def partition(param_counts: list[int], num_chunks: int) -> list[range]:
    """Split blocks into `num_chunks` contiguous non-empty ranges, minimising the largest sum.

    Exact. Among the splits with the smallest maximum, the one with the smallest sum of
    squares wins (the other chunks are balanced too); a remaining tie goes to the split
    whose chunk boundaries come first.
    """
    n = len(param_counts)
    if num_chunks < 1:
        raise ValueError(f"num_chunks = {num_chunks}: need at least 1")
    if n < num_chunks:
        raise ValueError(
            f"cannot split {n} blocks into {num_chunks} non-empty chunks: "
            f"use fewer stages (pp * virtual stages) or a deeper model"
        )
    prefix = [0]
    for c in param_counts:
        prefix.append(prefix[-1] + c)

    # pass 1: smallest achievable maximum; best_max[j][i] = first i blocks in j chunks
    inf = float("inf")
    best_max = [[inf] * (n + 1) for _ in range(num_chunks + 1)]
    best_max[0][0] = 0
    for j in range(1, num_chunks + 1):
        for i in range(j, n - (num_chunks - j) + 1):
            best_max[j][i] = min(
                max(best_max[j - 1][s], prefix[i] - prefix[s]) for s in range(j - 1, i)
            )
    limit = best_max[num_chunks][n]

    # pass 2: among splits whose chunks all fit in `limit`, the smallest sum of squares
    best_sq = [[inf] * (n + 1) for _ in range(num_chunks + 1)]
    start = [[0] * (n + 1) for _ in range(num_chunks + 1)]
    best_sq[0][0] = 0
    for j in range(1, num_chunks + 1):
        for i in range(j, n - (num_chunks - j) + 1):
            for s in range(j - 1, i):
                size = prefix[i] - prefix[s]
                if size > limit or best_sq[j - 1][s] == inf:
                    continue
                cost = best_sq[j - 1][s] + size * size
                if cost < best_sq[j][i]:  # strict: the earliest boundary keeps a tie
                    best_sq[j][i] = cost
                    start[j][i] = s

    ranges: list[range] = []
    i = n
    for j in range(num_chunks, 0, -1):
        s = start[j][i]
        ranges.append(range(s, i))
        i = s
    return ranges[::-1]


MAX_SPLITS = 200_000  # balanced_for_ranks tries every split up to this many, else partition()


def balanced_for_ranks(costs: list[float], rank_of: list[int]) -> list[range]:
    """Split blocks into len(rank_of) contiguous non-empty chunks, chunk c running on rank
    rank_of[c]: the busiest rank's total as small as possible, then the largest chunk, then the
    sum of squares (the earliest boundaries keep a tie). With one chunk per rank this is
    partition()'s answer; a V (rank r holds chunks r and 2p-1-r) or a loop of several chunks per
    rank balances the ranks, not the chunks. Tries every split; when there are more than
    MAX_SPLITS, partition()'s."""
    n, k = len(costs), len(rank_of)
    if k > n:
        return partition(costs, k)  # raises: too few blocks
    if math.comb(n - 1, k - 1) > MAX_SPLITS:
        return partition(costs, k)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best, best_bounds = None, None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        sizes = [prefix[bounds[i + 1]] - prefix[bounds[i]] for i in range(k)]
        loads: dict[int, float] = {}
        for r, size in zip(rank_of, sizes, strict=True):
            loads[r] = loads.get(r, 0.0) + size
        key = (max(loads.values()), max(sizes), sum(x * x for x in sizes))
        if best is None or key < best:
            best, best_bounds = key, bounds
    return [range(best_bounds[i], best_bounds[i + 1]) for i in range(k)]


def layer_counts(cfg, ranges: list[range]) -> list[int]:
    """A split of the blocks as `model.partition`'s list: the layers of each chunk (gpt: the
    embedding rides with the first chunk and the head with the last, so those may count 0)."""
    kind = model_kind(cfg.kind)
    counts = [len(r) for r in ranges]
    counts[0] -= len(kind.lead)
    counts[-1] -= len(kind.trail)
    return counts


class Recompute(NamedTuple):
    """What a forward keeps under train.recompute = "full": the stage's input alone; the
    backward runs the forward again from it (the same operations: the same bits)."""

    input: np.ndarray


class Stage:
    """A contiguous slice of blocks that one rank owns (one model chunk).

    recompute: forward keeps only its input (Recompute) and the backward redoes the forward
    just before it: activation memory of one micro-batch in flight falls to its input, for
    one more forward per micro-batch.
    """

    recompute: bool = False

    def __init__(
        self, blocks: list[Block], first_block: int, seed: int, dtype: np.dtype = np.float32
    ) -> None:
        self.blocks = blocks
        self.block_range = range(first_block, first_block + len(blocks))
        self.layers: list[Layer] = [layer for block in blocks for layer in block]
        self.num_params = sum(block_num_params(b) for b in blocks)
        self.flat_params = np.zeros(self.num_params, dtype=dtype)
        self.flat_grads = np.zeros(self.num_params, dtype=dtype)

        self._bind()
        for g, block in zip(self.block_range, blocks, strict=True):
            rng = np.random.default_rng([seed, g])
            for layer in block:
                layer.init_params(layer.params, rng)

    def _bind(self) -> None:
        """Hand every layer its views of the flat parameter and gradient buffers."""
        offset = 0
        self.param_ranges: list[tuple[int, int]] = []  # layer i's parameters: [lo, hi) of flat
        self.tensor_offsets: list[int] = []  # where each parameter tensor starts in flat
        for layer in self.layers:
            params, grads = {}, {}
            lo = offset
            for name, shape in layer.param_shapes().items():
                size = math.prod(shape)
                self.tensor_offsets.append(offset)
                params[name] = self.flat_params[offset : offset + size].reshape(shape)
                grads[name] = self.flat_grads[offset : offset + size].reshape(shape)
                offset += size
            layer.bind(params, grads)
            self.param_ranges.append((lo, offset))

    def to_device(self, asarray) -> None:
        """Move the flat buffers (initialised on the host) with `asarray`, e.g. to the GPU."""
        self.flat_params = asarray(self.flat_params)
        self.flat_grads = asarray(self.flat_grads)
        self._bind()

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        # the caches keep references to their inputs (x included): a caller must not
        # overwrite x in place until the matching backward has run
        y, caches = self._forward(x)
        return (y, Recompute(x)) if self.recompute else (y, caches)

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, list]:
        caches = []
        for layer in self.layers:
            x, cache = layer.forward(x)
            caches.append(cache)
        return x, caches

    def _caches(self, cache: object) -> list:
        """The layers' caches: a Recompute's forward done again (its output is not needed)."""
        return self._forward(cache.input)[1] if isinstance(cache, Recompute) else cache

    def backward(
        self, dy: np.ndarray, cache: object, need_dx: bool = True, on_grad: GradHook | None = None
    ) -> np.ndarray | None:
        """need_dx=False (the model's first stage): the first layer skips its input gradient.
        on_grad(lo): called after each layer, from the last: its gradients (flat offsets >= lo)
        are written (the gradient buckets start from it on the step's last backward)."""
        cache = self._caches(cache)
        last = len(self.layers) - 1
        for i, (layer, c) in enumerate(zip(reversed(self.layers), reversed(cache), strict=True)):
            dy = layer.backward(dy, c, need_dx or i < last)
            if on_grad is not None:
                on_grad(self.param_ranges[last - i][0])
        return dy

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        """The input gradient alone; returns it and what backward_weight needs (kept until
        the W: a recomputed forward is not redone for it)."""
        cache = self._caches(cache)
        wcaches = []
        last = len(self.layers) - 1
        for i, (layer, c) in enumerate(zip(reversed(self.layers), reversed(cache), strict=True)):
            dy, wcache = layer.backward_input(dy, c, need_dx or i < last)
            wcaches.append(wcache)
        return dy, wcaches[::-1]

    def backward_weight(self, wcache: object, on_grad: GradHook | None = None) -> None:
        """From the last layer to the first, like backward (each layer's weight gradient stands
        alone: the order changes no bits, and the end of the buffer is final first)."""
        for (lo, _), layer, wc in zip(
            reversed(self.param_ranges), reversed(self.layers), reversed(wcache), strict=True
        ):
            layer.backward_weight(wc)
            if on_grad is not None:
                on_grad(lo)

    def backward_weight_merged(
        self, wcaches: list[object], on_grad: GradHook | None = None
    ) -> None:
        """The weight gradients of k micro-batches (their backward_input wcaches) as one pass:
        each layer takes all k at once (a Linear: one GEMM over their rows, Linear.
        backward_weight_merged), from the last layer to the first, on_grad(lo) after each as
        backward_weight calls it. Sums as k backward_weight calls do, within float32 rounding."""
        if not wcaches:
            raise ValueError("backward_weight_merged: no micro-batches to merge")
        for i in reversed(range(len(self.layers))):
            self.layers[i].backward_weight_merged([wc[i] for wc in wcaches])
            if on_grad is not None:
                on_grad(self.param_ranges[i][0])

    def zero_grad(self) -> None:
        self.flat_grads.fill(0)

    def flops(self, batch: int) -> int:
        """Forward FLOPs for `batch` rows (a full backward costs about twice as much)."""
        return sum(layer.flops(batch) for layer in self.layers)

    def activation_nbytes(self, cache: object) -> int:
        """Bytes of the arrays a forward (or weight) cache keeps alive, each counted once."""
        # keyed by (address, size): the same memory reached through two views counts once,
        # while a slice of a big array (a micro-batch of the data set) counts only itself
        seen: set[tuple[int, int]] = set()
        stack = [cache]
        while stack:
            item = stack.pop()
            if isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, np.ndarray):
                seen.add((item.__array_interface__["data"][0], item.nbytes))
            elif hasattr(item, "__cuda_array_interface__"):  # a CuPy array
                seen.add((item.__cuda_array_interface__["data"][0], item.nbytes))
        return sum(nbytes for _, nbytes in seen)


def block_costs(blocks: list[Block]) -> list[int]:
    """Estimated training FLOPs of each block per row: forward, input gradient, weight gradient.

    Each matmul costs the same three times (forward, dx, dW); the model's first layer skips
    its input gradient (nothing before it needs one). Elementwise work is not counted.
    """
    costs = [3 * sum(layer.flops(1) for layer in block) for block in blocks]
    if blocks and blocks[0]:
        costs[0] -= blocks[0][0].flops(1)
    return costs


def _inner(cfg, num_blocks: int) -> tuple[int, int]:
    """(blocks before the partitioned layers, number of those layers): gpt's embedding leads."""
    kind = model_kind(cfg.kind)
    return len(kind.lead), num_blocks - len(kind.ends)


def chunk_ranges(cfg, blocks: list[Block], num_chunks: int) -> list[range]:
    """Which blocks each of `num_chunks` chunks holds, following `cfg.partition`."""
    mode = cfg.partition
    if num_chunks == 1:  # the whole model, whatever the split for a pipeline would be
        return [range(len(blocks))]
    if mode == "cost":
        return partition(block_costs(blocks), num_chunks)
    lead, layers = _inner(cfg, len(blocks))
    if mode == "uniform":
        if layers < num_chunks:
            raise ValueError(
                f"model.partition = 'uniform' needs at least one layer per chunk: "
                f"{layers} layers < {num_chunks} chunks"
            )
        base, extra = divmod(layers, num_chunks)
        counts = [base + (c < extra) for c in range(num_chunks)]
    elif isinstance(mode, list):
        counts = list(mode)
        check_counts(counts, layers, num_chunks, ends_may_be_empty=bool(model_kind(cfg.kind).ends))
    elif mode == "timed":
        raise ValueError(
            "model.partition = 'timed' is measured before the run "
            "(train.partition.resolve_partition): resolve the job first"
        )
    else:
        raise ValueError(
            f"model.partition = {mode!r}: use 'cost', 'uniform', 'timed' or a list of counts"
        )
    # the embedding (gpt) joins the first chunk; whatever follows the layers joins the last
    bounds = [0] + [lead + sum(counts[: c + 1]) for c in range(num_chunks - 1)] + [len(blocks)]
    return [range(bounds[c], bounds[c + 1]) for c in range(num_chunks)]


def check_counts(counts: list, layers: int, num_chunks: int, ends_may_be_empty=False) -> None:
    """An explicit partition: one positive layer count per chunk, adding up to the model.
    ends_may_be_empty (gpt): the first and the last count may be 0, a chunk that holds only
    the embedding or only the head."""
    if len(counts) != num_chunks:
        raise ValueError(
            f"model.partition = {counts}: {len(counts)} counts for {num_chunks} chunks "
            f"(pp * virtual_stages)"
        )
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts) or any(
        n < (0 if ends_may_be_empty and c in (0, num_chunks - 1) else 1)
        for c, n in enumerate(counts)
    ):
        least = (
            "(0 allowed first and last: the embedding or the head alone)"
            if ends_may_be_empty
            else ""
        )
        raise ValueError(
            f"model.partition = {counts}: every count must be an integer >= 1 {least}".rstrip()
        )
    if sum(counts) != layers:
        raise ValueError(
            f"model.partition = {counts}: counts add up to {sum(counts)}, "
            f"the model has {layers} layers"
        )


def stage_ranges(cfg, in_features: int, num_classes: int, num_chunks: int) -> list[range]:
    """Which blocks each of `num_chunks` model chunks holds."""
    return chunk_ranges(cfg, build_blocks(cfg, in_features, num_classes), num_chunks)


def stage_num_params(cfg, in_features: int, num_classes: int, num_chunks: int) -> list[int]:
    """Parameters of each model chunk, from the model's description alone (no weights drawn)."""
    blocks = build_blocks(cfg, in_features, num_classes)
    counts = [block_num_params(b) for b in blocks]
    return [sum(counts[r.start : r.stop]) for r in chunk_ranges(cfg, blocks, num_chunks)]


def build_stage(
    cfg,
    in_features: int,
    num_classes: int,
    chunk: int,
    num_chunks: int,
    *,
    seed: int,
    dtype: np.dtype = np.float32,
) -> Stage:
    """Model chunk `chunk` of `num_chunks`; `build_stage(cfg, ..., 0, 1, seed)` is all of it."""
    if not 0 <= chunk < num_chunks:
        raise ValueError(f"chunk = {chunk}: must be in [0, {num_chunks})")
    blocks = build_blocks(cfg, in_features, num_classes)
    r = chunk_ranges(cfg, blocks, num_chunks)[chunk]
    return Stage(blocks[r.start : r.stop], r.start, seed, dtype)


def boundary_shapes(
    cfg, in_features: int, num_classes: int, num_chunks: int, batch: int
) -> list[tuple[int, ...]]:
    """Input shape of each chunk for `batch` samples: what crosses each pipeline boundary.

    gpt: chunk 0 takes the tokens (batch, T); every later chunk a (batch, T, C) activation.
    """
    kind = model_kind(cfg.kind)
    blocks = build_blocks(cfg, in_features, num_classes)
    ranges = chunk_ranges(cfg, blocks, num_chunks)
    after = [(batch, *kind.activation(cfg, in_features, blocks[r.start][0])) for r in ranges[1:]]
    return [(batch, in_features), *after]
