"""The oracle of the equivalence tests: one process, the whole model, the whole global batch.

It shares the layers, the data and the optimizer with mpihybrid but none of the pipeline:
no schedule, no messages, no micro-batches, no all-reduce.
"""

from __future__ import annotations

import numpy as np

from mpihybrid.nn.data import build_task
from mpihybrid.nn.loss import SoftmaxCrossEntropy
from mpihybrid.nn.model import build_stage
from mpihybrid.nn.optim import build_optimizer, clip_coefficient, learning_rate
from mpihybrid.train.state import decayed_ranges
from mpihybrid.train.tie import bind_local


def train_serial(job, norms: list | None = None) -> tuple[np.ndarray, list[float]]:
    """Final flat parameters and per-step losses of the job trained serially; `norms` gets each
    step's gradient norm (before train.grad_clip clips it)."""
    task = build_task(job.data)
    model = build_stage(job.model, task.in_features, task.num_classes, 0, 1, seed=job.train.seed)
    bind_local([model], job.model)  # model.tie_embeddings: the head's weight is the table's
    optimizer = build_optimizer(job.train, model.flat_params)
    optimizer.decayed = decayed_ranges(model, job.train.weight_decay_on)
    loss_fn = SoftmaxCrossEntropy()
    losses = []
    for step in range(job.train.steps):
        model.zero_grad()
        x, y = task.global_batch(step, job.train.global_batch)
        logits, cache = model.forward(x)
        loss, loss_cache = loss_fn.forward(logits, y)
        model.backward(loss_fn.backward(loss_cache), cache)
        g = model.flat_grads
        norm = float(np.sqrt(np.dot(g, g)))
        if norms is not None:
            norms.append(norm)
        coef = clip_coefficient(norm, job.train.grad_clip)
        if coef < 1.0:
            g *= np.float32(coef)
        optimizer.step(g, learning_rate(job.train, step))
        losses.append(loss)
    return model.flat_params, losses
