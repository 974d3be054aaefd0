"""What a job's chunks compute per micro-batch, before any device is chosen: every layer's cost
as the layer declares it (`Layer.cost` beside its forward and backward, layers.py and
transformer.py), the loss, the parameters, the activations kept and what crosses each pipeline
boundary. Read by `mpihybrid predict`, bench train's roofline and the memory check (one
declaration, three readers).

    work = stage_work(job.workload)   # one ChunkWork per model chunk (pp x virtual_stages)
    work[c].layers[i].gemms["W"]  # [(batch, m, k, n), ...] of top-level layer i's weight pass

Rows of a micro-batch: samples (MLP), or samples x tokens (GPT). The loss (last chunk): the
softmax in place and argmax, F 12 r K bytes; the gradient scaled in place, B 8 r K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mpihybrid.nn.data import task_dims
from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.layers import FLOAT, PASSES, Cost, Gemm, layer_costs, matmul_flops
from mpihybrid.nn.model import boundary_shapes, build_blocks, chunk_ranges

KINDS = PASSES


@dataclass(frozen=True)
class Workload:
    """What nn/ needs of a job: its [model] and [data] sections and four numbers
    (config.Job.workload makes it; nn/ never sees the whole job)."""

    model: Any  # config.ModelConfig
    data: Any  # config.DataConfig
    chunks: int  # model chunks: pp x virtual_stages
    microbatches: int  # M, per replica per step
    microbatch_size: int  # samples in one micro-batch
    seed: int = 0  # parameter initialisation (train.seed)

    @property
    def rows(self) -> int:
        """Rows of one micro-batch: samples, or samples x tokens for a GPT."""
        return self.microbatch_size * model_kind(self.model.kind).tokens_per_sample(
            self.data.seq_len
        )


@dataclass
class ChunkWork:
    """One model chunk's work for one micro-batch."""

    layers: list[Cost]  # top-level layers in the stage's order (its flat buffers' order; a
    # Residual counts as one: the runtime reports weight gradients final per top-level layer)
    params: int
    activation_bytes: int  # what one micro-batch's forward keeps alive (the runtime's count)
    input_bytes: int  # the activation this chunk receives per micro-batch (0: chunk 0)
    largest_temporary: int  # bytes of the largest array a pass allocates and drops (workspace)

    def gemms(self, kind: str) -> list[Gemm]:
        return [g for layer in self.layers for g in layer.gemms[kind]]

    def flops(self, kind: str) -> float:
        return float(sum(layer.flops(kind) for layer in self.layers))

    def elem_bytes(self, kind: str) -> float:
        return sum(layer.elem_bytes[kind] for layer in self.layers)

    def calls(self, kind: str) -> int:
        return sum(layer.calls[kind] for layer in self.layers)

    def merged_w_bytes(self, rows: int) -> int:
        """Bytes a merged W over `rows` rows in all (k micro-batches of r rows: k r) keeps in nn/
        gemm's gather scratch: one gather of the chunk's widest Linear (the scratch is shared)."""
        return rows * max((layer.merge_row_bytes for layer in self.layers), default=0)


def microbatch_rows(work: Workload) -> tuple[int, int]:
    """(samples, rows) of one micro-batch: rows are samples x tokens for a GPT."""
    return work.microbatch_size, work.rows


def model_costs(work: Workload, rows: int) -> list[list[Cost]]:
    """Every top-level layer's declared cost on `rows` rows, block by block (the model's first
    layer without its input gradient)."""
    m = work.model
    in_features, num_classes = task_dims(work.data)
    width = model_kind(m.kind).input_width(in_features)  # a GPT's first layer takes token ids
    out = []
    for g, block in enumerate(build_blocks(m, in_features, num_classes)):
        costs = layer_costs(block, rows, width, need_dx=g > 0)
        width = costs[-1].out_width
        out.append(costs)
    return out


def model_gemms(work: Workload) -> list[Gemm]:
    """Every matmul of one micro-batch's forward and backward through the whole model, as the
    layers declare them (Layer.cost: the roofline runs the model's own shapes)."""
    return [
        g
        for block in model_costs(work, work.rows)
        for c in block
        for p in PASSES
        for g in c.gemms[p]
    ]


def gemm_flops(gemms: list[Gemm]) -> int:
    return sum(matmul_flops(g) for g in gemms)


def stage_work(work: Workload) -> list[ChunkWork]:
    """Every chunk's work per micro-batch (pp x virtual_stages chunks)."""
    m = work.model
    in_features, num_classes = task_dims(work.data)
    blocks = build_blocks(m, in_features, num_classes)
    shapes = boundary_shapes(m, in_features, num_classes, work.chunks, work.microbatch_size)
    return _works(work, chunk_ranges(m, blocks, work.chunks), shapes)


def block_work(work: Workload) -> list[ChunkWork]:
    """Every block's work per micro-batch, as if each were a chunk of its own (the loss rides
    with the last; no input bytes): what a schedule search splits into chunks."""
    in_features, num_classes = task_dims(work.data)
    blocks = build_blocks(work.model, in_features, num_classes)
    return _works(work, [range(g, g + 1) for g in range(len(blocks))], None)


def _works(work: Workload, ranges: list[range], shapes) -> list[ChunkWork]:
    num_classes = task_dims(work.data)[1]
    num_chunks, rows = len(ranges), work.rows
    costs = model_costs(work, rows)
    out = []
    for c, chunk in enumerate(ranges):
        layers = [cost for g in chunk for cost in costs[g]]
        temporary = max(layer.temporary_bytes for layer in layers)
        # the loss: softmax over the logits, forward and backward (vocab_parallel: the shares')
        if c == num_chunks - 1 and not getattr(work.model, "vocab_parallel", False):
            layers[-1].elem_bytes["F"] += 3 * FLOAT * rows * num_classes
            layers[-1].elem_bytes["B"] += 2 * FLOAT * rows * num_classes
            temporary = max(temporary, FLOAT * rows * num_classes)
        input_bytes = FLOAT * math.prod(shapes[c]) if c and shapes else 0
        params = sum(layer.params for layer in layers)
        kept = sum(layer.kept_bytes for layer in layers)
        out.append(ChunkWork(layers, params, kept, input_bytes, temporary))
    return out
