"""train.grad_clip: the global gradient norm over every parameter of every stage, and the clip.

    norm, bad = global_norm(world, reducers)   # collective; the same float on every rank
    coef = clip_coefficient(norm, max_norm)    # torch's clip_grad_norm_: max_norm / (norm + 1e-6)
    optimizer.scale_gradients(coef)            # each held bucket's update reads grads * coef

The norm is taken after the gradient rings, from the reduced gradient each rank owns: without
the sharded optimizer replica 0 of each stage owns all of its stage's (the replicas hold the same
bits), with it every replica owns its chunks of every bucket (nobody else holds them reduced).
Each bucket's sum of squares (a float32 dot) is taken on the communication thread as its ring
ends (comm.buckets.Reducer.sum_of_squares), behind the compute like the ring; after the
pipeline only the buckets' sums are added (in float64, stage and bucket order), all-gathered
over the world and summed in rank order, so every rank -- every replica, every stage --
computes the same norm to the bit, and the replicas update by the same coefficient. With fp32
communication it is the serial run's norm to float summation order.

The optimizer needs the norm before it updates, while the norm needs every bucket of every
stage: with clipping on, a reduced bucket is held (buckets.Reducer.hold) and the updates run
after the norm, at the end of the step. The coefficient goes into the optimizer's own pass
(nn.optim's scale_gradients), not into a pass of its own over the gradient. The sums also say
which stages' gradients are not finite (a nan or an inf makes its bucket's sum one), so the
step's end needs no other pass over the gradient for that (train.state.nonfinite_stages).
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from mpihybrid.nn.optim import clip_coefficient

__all__ = ["clip_coefficient", "global_norm", "owned_sums"]


def owned_sums(reducers: dict) -> dict[int, float]:
    """Each stage's share of the squared norm on this rank: its held buckets' sums of squares
    (a tied table once: the head's copy is no stage's parameter, train/tie.py)."""
    return {s: math.fsum(reducers[s].sumsq) for s in sorted(reducers)}


def global_norm(world: MPI.Comm, reducers: dict) -> tuple[float, list[int]]:
    """Collective over `world`: the l2 norm of the whole model's reduced gradient, and the
    stages of this rank whose owned gradient is not finite."""
    sums = owned_sums(reducers)
    mine = np.array([math.fsum(sums.values())], np.float64)
    every = np.empty(world.Get_size(), np.float64)
    world.Allgather(mine, every)
    bad = [s for s, x in sums.items() if not math.isfinite(x)]
    return math.sqrt(math.fsum(every.tolist())), bad
