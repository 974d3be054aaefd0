"""A chunk this rank holds, as one thing: its layers and flat buffers (nn.model.Stage), its
optimizer and its gradient's reducer (comm.buckets.Reducer), bound to each other once.

    states = build_states(job, stages, gradcomm)     # {stage index: StageState}
    st.begin_step(lr)     # every step: gradients zeroed, the optimizer's step begun at rate lr
    ...                   # the runtime's backward -> st.reducer.ready_from(lo) -> the ring
                          #   -> reducer.update(lo, hi) -> optimizer.update(flat_grads, lo, hi)

What checkpoints save and restore, what the runtime runs and the ring reduces: one object per
chunk instead of three dicts kept in step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpihybrid.comm.buckets import GradientComm, Reducer
from mpihybrid.config import Job
from mpihybrid.nn.model import Stage
from mpihybrid.nn.optim import ShardedOptimizer, build_optimizer


@dataclass
class StageState:
    index: int  # the chunk's global stage index
    stage: Stage
    optimizer: object  # nn.optim: SGD | AdamW | ShardedOptimizer over stage.flat_params
    reducer: Reducer  # the stage's gradient buckets and their rings (and the residual)

    def __post_init__(self) -> None:
        self.reducer.bind(self.optimizer)  # a reduced bucket is this optimizer's update

    @property
    def sharded(self) -> bool:
        """train.shard_optimizer: this replica's optimizer holds the state of its chunks only."""
        return isinstance(self.optimizer, ShardedOptimizer)

    def begin_step(self, lr: float) -> None:
        """A new step at rate `lr`: gradients zeroed, the optimizer's step begun."""
        self.stage.zero_grad()
        self.optimizer.begin_step(lr)
        self.reducer.begin_step()


def nonfinite_stages(stages: dict[int, Stage]) -> list[int]:
    """The stages whose reduced gradient holds a nan or an inf: one sum over each flat gradient
    (nan and inf survive a sum; a finite gradient's fp32 sum overflows only past 3e38, and a
    gradient that large has diverged anyway)."""
    return [s for s, st in stages.items() if not math.isfinite(float(st.flat_grads.sum()))]


def build_states(job: Job, stages: dict[int, Stage], gradcomm: GradientComm) -> dict:
    """Every chunk's StageState: the reducer over its gradient (gradcomm.settings: the codec,
    the buckets; sharded: reduce-scatter, then the weights gathered in comm.param_codec), the
    optimizer over its parameters (sharded: over the chunks of the buckets this replica owns,
    with an fp32 master copy when the weight gather is lossy)."""
    t = job.train
    states = {}
    for s, st in stages.items():
        reducer = gradcomm.reducer(
            s,
            st.flat_grads,
            st.param_ranges,
            flat_params=st.flat_params,
            tensor_offsets=tuple(st.tensor_offsets),
        )
        if t.shard_optimizer:
            optimizer = ShardedOptimizer(t, st.flat_params, reducer.owned, reducer.lossy_gather)
        else:
            optimizer = build_optimizer(t, st.flat_params)
        optimizer.decayed = decayed_ranges(st, t.weight_decay_on)
        reducer.hold = t.grad_clip > 0  # the updates wait for the global norm (train/clip.py)
        states[s] = StageState(s, st, optimizer, reducer)
    return states


def decayed_ranges(stage: Stage, rule: str) -> list[tuple[int, int]] | None:
    """The [lo, hi) ranges of a stage's flat parameters that train.weight_decay decays under
    train.weight_decay_on: "matrices" every 2-D weight but the embeddings' tables, "matrices+
    embeddings" those too (nanoGPT's rule), "all" everything (None)."""
    from mpihybrid.nn.transformer import Embedding

    if rule == "all":
        return None
    tensors = [(layer, shape) for layer in stage.layers for shape in layer.param_shapes().values()]
    out = []
    for (layer, shape), lo in zip(tensors, stage.tensor_offsets, strict=True):
        table = isinstance(layer, Embedding)
        if len(shape) >= 2 and (not table or rule == "matrices+embeddings"):
            out.append((lo, lo + math.prod(shape)))
    return out
