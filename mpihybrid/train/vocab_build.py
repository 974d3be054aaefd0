"""model.vocab_parallel in a run: this rank's share of the vocabulary as a chunk of its own, the
schedule's vocabulary passes, and the runtime that runs them (nn/vocab.py, pipeline/vocab_*.py).

    compute = with_passes(job, task, compute, placement)   # E, S, T, G placed on every rank
    shards = share_chunks(job, task, grid, num_stages)     # {num_stages + pp_rank: Stage} | {}
    attach(runtime, shards, states, job, task, grid)       # the runtime runs the passes

The share is a chunk like the stages' (one flat buffer, its optimizer, its gradient's buckets and
ring over the replicas of the rank), indexed num_stages + pp_rank so every index names one chunk
of the model; it is no pipeline stage (no F or B of its own).
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

from mpihybrid.nn.layers import layer_costs
from mpihybrid.nn.model import Stage, build_blocks, chunk_ranges
from mpihybrid.nn.vocab import VocabShard, padding, share_layer
from mpihybrid.nn.vocab_weights import load_share
from mpihybrid.pipeline.runtime import tag_for
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.pipeline.vocab_passes import add_vocab_passes
from mpihybrid.pipeline.vocab_runtime import VocabRuntime

log = logging.getLogger("mpihybrid")
GEMM_RATE, BYTE_RATE = 1e9, 1e10  # relative costs only: FLOPs and bytes to comparable seconds


def _shard(job, task, pp: int, rank: int) -> VocabShard:
    return share_layer(job.model, task.in_features, task.num_classes, pp, rank, seed=job.train.seed)


def share_memory(job, pp_rank: int, placement) -> dict[str, int]:
    """Bytes the rank's share adds to its memory (train.memory; 0s without vocab_parallel):
    its parameters; the step's receive buffers (posted when it begins: every micro-batch's);
    one micro-batch's S cache (the exps of its logits, the last stage's output) held until its
    T; the logits' largest temporary."""
    if not job.model.vocab_parallel:
        return {"params": 0, "buffers": 0, "activations": 0, "temporary": 0}
    task = SimpleNamespace(in_features=job.data.seq_len, num_classes=job.data.vocab)
    pp, m, c = job.grid.pp, job.train.microbatches, job.model.hidden
    layer = _shard(job, task, pp, pp_rank)
    rows = job.microbatch_size * job.data.seq_len
    act = 4 * rows * c
    per_mb = (pp - 1) * 4 * 4 * rows  # the other shares' statistics
    per_mb += (pp - 1) * act if pp_rank == placement.rank_of(0) else act  # parts | dx
    per_mb += (pp - 1) * act if pp_rank == placement.rank_of(placement.num_stages - 1) else act
    return {
        "params": sum(math.prod(shape) for shape in layer.param_shapes().values()),
        "buffers": m * per_mb,
        "activations": 4 * rows * layer.share + act,
        "temporary": 4 * rows * layer.share,
    }


def pass_costs(job, task, placement) -> Costs:
    """Seconds-like costs of every stage's F, B, W and of the vocabulary passes on one
    micro-batch, from the layers' cost declarations: what places the passes."""
    m = job.model
    rows = job.microbatch_size * task.in_features  # tokens
    blocks = build_blocks(m, task.in_features, task.num_classes)
    ranges = chunk_ranges(m, blocks, placement.num_stages)
    per_pass = {"F": [], "B": [], "W": []}
    for r in ranges:
        layers = [layer for block in blocks[r.start : r.stop] for layer in block]
        costs = layer_costs(layers, rows, m.hidden)
        for p in per_pass:
            flops = sum(c.flops(p) for c in costs)
            moved = sum(c.elem_bytes[p] for c in costs)
            per_pass[p].append(flops / GEMM_RATE + moved / BYTE_RATE)
    share = _shard(job, task, placement.pp, 0).cost(rows, m.hidden)
    small = rows * m.hidden * 12 / BYTE_RATE  # a gather or scatter-add of the rows
    vocab = {
        "E": small,
        "S": share.flops("F") / GEMM_RATE + share.elem_bytes["F"] / BYTE_RATE,
        "T": (share.flops("B") + share.flops("W")) / GEMM_RATE + share.elem_bytes["B"] / BYTE_RATE,
        "G": small,
    }
    return Costs(per_pass["F"], per_pass["B"], per_pass["W"], vocab=vocab)


def with_passes(job, task, compute: dict, placement) -> dict:
    """The compute lists with the vocabulary passes placed (vocab_passes.add_vocab_passes)."""
    costs = pass_costs(job, task, placement)
    return add_vocab_passes(compute, placement, job.train.microbatches, costs, simulate)


def share_chunks(job, task, grid, num_stages: int) -> dict[int, Stage]:
    """This rank's share as a chunk, {num_stages + pp_rank: Stage}; {} without vocab_parallel."""
    if not job.model.vocab_parallel:
        return {}
    pp, vocab = grid.pp_size, task.num_classes
    if padding(vocab, pp) and grid.pp_rank == 0 and grid.dp_rank == 0:
        log.info(
            "model.vocab_parallel: data.vocab = %d is not divisible by pp = %d: padded to %d "
            "(rows of zeros whose logits are left out of the loss)",
            vocab,
            pp,
            vocab + padding(vocab, pp),
        )
    layer = _shard(job, task, pp, grid.pp_rank)
    stage = Stage([[layer]], 0, job.train.seed)
    if job.model.init:  # the whole model's file (config.validate checked it), cut to the share
        load_share(layer, job.model.init)
    return {num_stages + grid.pp_rank: stage}


def attach(runtime, shards: dict, states: dict, *, job, task, grid) -> None:
    """Give the runtime this rank's VocabRuntime (no-op without a share)."""
    if not shards:
        return
    (index, shard), m = next(iter(shards.items())), job.train.microbatches
    placement = runtime.placement
    last = tag_for("B", placement.num_stages - 1, m - 1, m)
    vocab = VocabRuntime(
        grid.pp_comm,
        shard,
        placement,
        m,
        (job.microbatch_size, task.in_features, job.model.hidden),
        recorder=runtime.recorder,
        peer_ranks=runtime.peer_ranks,
        isend=runtime.isend,
        tag_base=last + 1,
        grads_final=states[index].reducer.ready_from,
        last_grad=_last_grad(runtime.actions),
    )
    runtime.attach_vocab(vocab)


def _last_grad(actions) -> int:
    """The micro-batch of the rank's last G pass: the share's gradient is final after it."""
    return [a.microbatch for a in actions if a.kind == "G"][-1]
