"""Where a stage's compute goes, op by op: the kernel columns of `bench train`'s time split.

    from mpihybrid.nn.profile import profile_chunk
    ms = profile_chunk(job.workload, chunk=0, repeats=3)   # {"GEMM (Linear)": s, ...} per mb

Runs the job's micro-batches through one model chunk as a pipeline stage does (M forwards
with their activations alive, then M input and weight gradients; the last chunk's loss too),
each layer's passes timed; seconds per micro-batch by category. "glue" is the rest of the
chunk's time: residual adds, the Python between layers. Used by benchmarks/stage_profile.py
(one process) and by `bench train` (every rank at once, right after a measured repeat).
"""

from __future__ import annotations

import collections
import time

import numpy as np

from mpihybrid.nn.cost import Workload
from mpihybrid.nn.data import build_task, microbatches, task_dims
from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.layers import GELU, LayerNorm, Linear
from mpihybrid.nn.model import build_stage, layer_counts, partition
from mpihybrid.nn.transformer import CausalAttention, Embedding, Residual

CATEGORIES = {
    Linear: "GEMM (Linear)",
    CausalAttention: "attention",
    GELU: "GELU",
    LayerNorm: "LayerNorm",
    Embedding: "embedding",
}
LOSS, GLUE = "loss", "glue"


def timed(layer, totals: dict, key=None) -> None:
    """Wrap the layer's passes (and its branch's, for a Residual) with timers adding into
    totals[key(layer, method)] (default key: the category)."""
    if isinstance(layer, Residual):
        for sub in layer.branch:
            timed(sub, totals, key)
        return
    for method in ("forward", "backward_input", "backward_weight"):
        inner = getattr(layer, method)
        name = key(layer, method) if key else CATEGORIES.get(type(layer), type(layer).__name__)

        def wrapper(*args, _inner=inner, _key=name, **kwargs):
            start = time.perf_counter()
            out = _inner(*args, **kwargs)
            totals[_key] += time.perf_counter() - start
            return out

        setattr(layer, method, wrapper)


def chunk_inputs(work: Workload, chunk: int, seed: int = 0):
    """(inputs, targets) of a replica's M micro-batches for `chunk` (activations past chunk 0)."""
    task = build_task(work.data)
    m = work.microbatches
    x, y = task.global_batch(0, work.microbatch_size * m)
    batches = microbatches(x, y, 0, 1, m)
    # model.vocab_parallel: chunk 0 takes the vocabulary shares' summed embedding, not tokens
    if chunk == 0 and not vocab_parallel(work):
        return [b[0] for b in batches], [b[1] for b in batches]
    rng = np.random.default_rng(seed)
    stage = build_stage(work.model, task.in_features, task.num_classes, chunk, work.chunks, seed=0)
    kind = model_kind(work.model.kind)
    shape = (len(batches[0][0]), *kind.activation(work.model, task.in_features, stage.layers[0]))
    inputs = [rng.standard_normal(shape).astype(np.float32) for _ in range(m)]
    return inputs, [b[1] for b in batches]


def vocab_parallel(work: Workload) -> bool:
    """The job splits the head by vocabulary: no chunk computes the loss (nn/vocab.py)."""
    return bool(getattr(work.model, "vocab_parallel", False))


def chunk_loss(work: Workload):
    """The model kind's loss on the model's last block; None where the vocabulary shares
    compute it (model.vocab_parallel: no chunk does)."""
    return None if vocab_parallel(work) else model_kind(work.model.kind).loss()


def stage_wcaches(stage, inputs, targets, loss_fn, first: bool) -> list:
    """Each micro-batch's forward and input gradient through `stage` (the loss's gradient where
    loss_fn is given, else a constant one): the wcaches its weight gradients take, one per
    micro-batch (benchmarks/merged_w.py, tests/test_merged_w.py)."""
    wcaches = []
    for x, t in zip(inputs, targets, strict=True):
        out, cache = stage.forward(x)
        if loss_fn is None:
            dy = np.full_like(out, 1e-3)
        else:
            dy = loss_fn.step(out, t, 1.0 / len(inputs))[2]  # as training runs it
        wcaches.append(stage.backward_input(dy, cache, need_dx=not first)[1])
    return wcaches


def profile_stage(stage, inputs, targets, loss_fn, first: bool, *, repeats: int, key=None):
    """Seconds per micro-batch by category (or by `key(layer, method)`), glue included.
    loss_fn: the model kind's loss where the stage ends the model (None: it does not)."""
    totals: dict = collections.defaultdict(float)
    for layer in stage.layers:
        timed(layer, totals, key)
    for repeat in range(repeats + 1):
        if repeat == 1:  # the first pass warms up (and compiles)
            totals.clear()
            start = time.perf_counter()
        caches = [stage.forward(x) for x in inputs]
        for (out, cache), t in zip(caches, targets, strict=True):
            if loss_fn is not None:
                t0 = time.perf_counter()
                _, _, dy = loss_fn.step(out, t, 1.0 / len(inputs))  # as training runs it
                totals[LOSS] += time.perf_counter() - t0
            else:
                dy = np.full_like(out, 1e-3)
            _, wcache = stage.backward_input(dy, cache, need_dx=not first)
            stage.backward_weight(wcache)
    took = time.perf_counter() - start
    per_mb = repeats * len(inputs)
    result = {k: v / per_mb for k, v in totals.items()}
    result[GLUE] = max(0.0, took / per_mb - sum(result.values()))
    return result


def profile_chunk(work: Workload, chunk: int, repeats: int = 3, key=None) -> dict[str, float]:
    """profile_stage of model chunk `chunk`, on the job's own micro-batches."""
    stage = build_stage(work.model, *task_dims(work.data), chunk, work.chunks, seed=work.seed)
    inputs, targets = chunk_inputs(work, chunk)
    loss = chunk_loss(work) if chunk == work.chunks - 1 else None
    return profile_stage(stage, inputs, targets, loss, chunk == 0, repeats=repeats, key=key)


def timed_block_costs(work: Workload, repeats: int = 3) -> list[float]:
    """Seconds per micro-batch of each block of the whole model (F + B + W, the loss with the
    head), timed on the job's micro-batches as one stage: what `model.partition = "cost"`
    estimates from FLOPs, measured on this machine."""
    stage = build_stage(work.model, *task_dims(work.data), 0, 1, seed=work.seed)
    owner = {}
    for g, block in enumerate(stage.blocks):
        for layer in block:
            for sub in layer.branch if isinstance(layer, Residual) else [layer]:
                owner[id(sub)] = g
    inputs, targets = chunk_inputs(work, 0)
    loss = chunk_loss(work)
    per = profile_stage(
        stage, inputs, targets, loss, True, repeats=repeats, key=lambda l, m: owner[id(l)]
    )
    costs = [per.get(g, 0.0) for g in range(len(stage.blocks))]
    costs[-1] += per.get(LOSS, 0.0)
    return costs


def block_pass_costs(
    work: Workload, repeats: int = 3
) -> tuple[list[float], list[float], list[float]]:
    """(F, B, W) seconds per micro-batch of each block of the whole model, timed apart on the
    job's micro-batches as one stage (timed_block_costs' run, each pass on its own): what a
    schedule search splits and orders. The loss rides with the head: its forward in F, its
    gradient in B."""
    stage = build_stage(work.model, *task_dims(work.data), 0, 1, seed=work.seed)
    owner = {}
    for g, block in enumerate(stage.blocks):
        for layer in block:
            for sub in layer.branch if isinstance(layer, Residual) else [layer]:
                owner[id(sub)] = g
    inputs, targets = chunk_inputs(work, 0)
    loss = chunk_loss(work)
    per = profile_stage(
        stage, inputs, targets, loss, True, repeats=repeats, key=lambda l, m: (owner[id(l)], m)
    )
    n = len(stage.blocks)
    passes = [
        [per.get((g, m), 0.0) for g in range(n)]
        for m in ("forward", "backward_input", "backward_weight")
    ]
    half = per.get(LOSS, 0.0) / 2  # timed as one: its forward and its gradient
    passes[0][-1] += half
    passes[1][-1] += half
    glue = per.get(GLUE, 0.0) / max(3 * n, 1)  # the Python between layers, spread evenly
    return tuple([x + glue for x in p] for p in passes)


def block_merge_ratios(work: Workload, repeats: int = 3) -> list[float]:
    """What each micro-batch beyond the first adds to a merged W of each block of the whole
    model, as a fraction of one W pass (job_costs makes SearchCosts.weight_more of it): the
    job's M micro-batches' W passes as one (backward_weight_merged: a GEMM per weight over
    their rows) against one at a time, block by block, the medians of `repeats` after a
    warm-up; a block without weights 1.0. [] where M is 1 (nothing to merge)."""
    import statistics

    m = work.microbatches
    if m < 2:
        return []
    stage = build_stage(work.model, *task_dims(work.data), 0, 1, seed=work.seed)
    inputs, targets = chunk_inputs(work, 0)
    wcaches = stage_wcaches(stage, inputs, targets, chunk_loss(work), True)
    where = {id(layer): i for i, layer in enumerate(stage.layers)}
    out = []
    for block in stage.blocks:
        index = [where[id(layer)] for layer in block]
        times = {"one": [], "merged": []}
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for i in index:
                for wc in wcaches:
                    stage.layers[i].backward_weight(wc[i])
            middle = time.perf_counter()
            for i in index:
                stage.layers[i].backward_weight_merged([wc[i] for wc in wcaches])
            times["one"].append(middle - start)
            times["merged"].append(time.perf_counter() - middle)
        one, merged = (statistics.median(t[1:]) / m for t in times.values())  # a micro-batch's
        out.append(max(0.0, (m * merged - one) / ((m - 1) * one)) if one > 0 else 1.0)
    return out


def block_update_costs(work: Workload, train, repeats: int = 3) -> list[float]:
    """Seconds of one optimizer update (train.optimizer) of each block's parameters: what a
    stage's last weight-gradient action carries besides its W on a CPU rank (the gradient
    buckets' updates run inside it), the median of `repeats` after a warm-up."""
    import statistics

    from mpihybrid.nn.model import block_num_params, build_blocks
    from mpihybrid.nn.optim import build_optimizer

    out = []
    for block in build_blocks(work.model, *task_dims(work.data)):
        n = block_num_params(block)
        if n == 0:
            out.append(0.0)
            continue
        params, grads = np.zeros(n, np.float32), np.full(n, 1e-3, np.float32)
        optimizer, times = build_optimizer(train, params), []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            optimizer.step(grads)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times[1:]))
    return out


def timed_partition(work: Workload, repeats: int = 3) -> tuple[list[int], list[float]]:
    """(layers per chunk, seconds per block): the split of `model.partition` that balances the
    blocks' measured seconds (nn.model.partition on them), as a list a job file takes."""
    costs = timed_block_costs(work, repeats)
    # the embedding and the head (gpt) ride with the first and last chunk
    return layer_counts(work.model, partition(costs, work.chunks)), costs


def share_pass_costs(job, repeats: int = 3) -> tuple[float, float, float, float]:
    """model.vocab_parallel: seconds of a share's E, S, T and G passes (nn/vocab.py) on one of
    the job's micro-batches, every share's statistics combined; medians of `repeats` after a
    warm-up."""
    import statistics

    from mpihybrid.nn.model import Stage
    from mpihybrid.nn.vocab import combine, share_layer

    d, m = job.data, job.model
    layer = share_layer(m, d.seq_len, d.vocab, job.grid.pp, 0, seed=job.train.seed)
    Stage([[layer]], 0, job.train.seed)  # binds the layer's parameters and gradients
    tokens, targets = build_task(d).global_batch(0, job.microbatch_size)  # one micro-batch
    h = np.random.default_rng(0).standard_normal((*tokens.shape, m.hidden)).astype(np.float32)
    times = {k: [] for k in "ESTG"}
    for _ in range(repeats + 1):
        marks = [time.perf_counter()]
        layer.embed(tokens)
        marks.append(time.perf_counter())
        cache, stats = layer.logits(h, targets)
        marks.append(time.perf_counter())
        layer.head_backward(cache, combine([stats] * job.grid.pp), 1.0)
        marks.append(time.perf_counter())
        layer.embed_grad(tokens, h)
        marks.append(time.perf_counter())
        for k, a, b in zip("ESTG", marks, marks[1:], strict=False):
            times[k].append(b - a)
    return tuple(statistics.median(times[k][1:]) for k in "ESTG")
