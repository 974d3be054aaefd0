"""model.tie_embeddings: nanoGPT's wte = lm_head, across the pipeline (Megatron's embedding group).

    tie_init(stage, cfg, seed)                    # the head's weight = the embedding's draw, .T
    sum_tied_grads(pp_comm, stages, placement)    # both copies get tokens + head.T, every step

The token table (V, C) lives in stage 0's embedding and the head's weight (C, V) in the last
stage. Where they sit on two ranks, each keeps a copy: both start from the embedding's draw
(block 0's generator), and every step, after the gradient rings, the two ranks of the pipeline
swap the two gradients and both write tokens + head.T into their own (float addition commutes:
the same bits on both), so the two copies take the same optimizer step and stay identical.
Where one rank holds both (pp = 1, or a V placement: rank 0 holds the first and the last
chunk) the sum is local, no message. The buckets are held until the sum is in (the machinery
of train.grad_clip), and a gradient norm counts the tied weight once (the head's copy is left
out). The sharded optimizer is not supported with tying (its owned chunks of the two layouts do
not line up): config validation refuses the pair.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.device import host_array
from mpihybrid.nn.transformer import GPT_INIT_STD

TAG = 7_900  # the tied gradients' messages on pp_comm


def _table(stage):
    """The stage's token table (V, C) if it holds the embedding, else None."""
    return stage.blocks[0][0].params["tokens"] if stage.block_range.start == 0 else None


def _head(stage, num_blocks: int):
    """The stage's head weight (C, V) if it holds the head, else None."""
    return stage.blocks[-1][1].params["weight"] if stage.block_range.stop == num_blocks else None


def tie_init(stage, cfg, seed: int) -> None:
    """A stage holding the head starts its weight from the embedding's token table (the draw of
    block 0's generator, as Embedding.init_params makes it), transposed."""
    head = _head(stage, cfg.depth + 2)
    if head is None:
        return
    rng = np.random.default_rng([seed, 0])
    vocab, width = head.shape[1], head.shape[0]
    head[...] = (rng.standard_normal((vocab, width)) * GPT_INIT_STD).T


def head_range(stage, num_blocks: int) -> tuple[int, int] | None:
    """The head weight's [lo, hi) in the stage's flat buffer (the tied copy a norm leaves out)."""
    head = _head(stage, num_blocks)
    if head is None:
        return None
    lo = stage.param_ranges[-1][0]  # the head Linear is the stage's last layer: weight first
    return lo, lo + head.size


def sum_tied_grads(pp_comm: MPI.Comm, stages: dict, placement, num_blocks: int) -> None:
    """Collective between the ranks of the first and the last stage (a no-op elsewhere): both
    copies' gradients become tokens + head.T."""
    first, last = 0, placement.num_stages - 1
    mine = {s for s in (first, last) if s in stages}
    if not mine:
        return
    if first == last or len(mine) == 2:  # one rank (or one stage) holds both: a local sum
        table, head = _grad_table(stages[first]), _grad_head(stages[last], num_blocks)
        total = table + head.T
        table[...] = total
        head[...] = total.T
        return
    (s,) = mine
    other = placement.rank_of(last if s == first else first)
    if s == first:
        table = _grad_table(stages[s])
        theirs = np.empty(table.shape[::-1], table.dtype)  # (C, V)
        pp_comm.Sendrecv(np.ascontiguousarray(host_array(table)), other, TAG, theirs, other, TAG)
        table += theirs.T
    else:
        head = _grad_head(stages[s], num_blocks)
        theirs = np.empty(head.shape[::-1], head.dtype)  # (V, C)
        pp_comm.Sendrecv(np.ascontiguousarray(host_array(head)), other, TAG, theirs, other, TAG)
        head[...] = (theirs + head.T).T  # tokens + head.T, the same order as the first's


def _grad_table(stage):
    return stage.blocks[0][0].grads["tokens"]


def _grad_head(stage, num_blocks: int):
    return stage.blocks[-1][1].grads["weight"]
