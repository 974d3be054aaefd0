"""train.grad_clip: the global gradient norm over every parameter of every stage, and the clip.

    norm = global_norm(world, states)          # collective; the same float on every rank
    coef = clip_coefficient(norm, max_norm)    # torch's clip_grad_norm_: max_norm / (norm + 1e-6)
    scale(states, coef)                        # the reduced gradients *= coef (fp32)

The norm is taken after the gradient rings, from the reduced gradient each rank owns: without
the sharded optimizer replica 0 of each stage owns all of its stage's (the replicas hold the same
bits), with it every replica owns its chunks of every bucket (nobody else holds them reduced).
Each rank's sum of squares (float64 over a float32 dot per stage) is all-gathered over the
world and summed in rank order, so every rank -- every replica, every stage -- computes the
same norm to the bit, and the replicas update by the same coefficient. With fp32 communication
it is the serial run's norm to float summation order.

The optimizer needs the norm before it updates, while the norm needs every bucket of every
stage: with clipping on, a reduced bucket is held (buckets.Reducer.hold) and the updates run
after the norm, at the end of the step (the rings still run behind the compute).
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.device import host_array
from mpihybrid.nn.optim import clip_coefficient

__all__ = ["clip_coefficient", "global_norm", "owned_sum_of_squares", "scale"]


def owned_sum_of_squares(stages: dict, rings: dict, dp_rank: int) -> float:
    """This rank's share of the squared norm: the reduced gradient it owns, every stage (a tied
    table once: the head's copy is no stage's parameter, train/tie.py)."""
    total = 0.0
    for s in sorted(stages):
        grads, ring = stages[s].flat_grads, rings[s]
        if ring.sharded:
            parts = [grads[lo:hi] for lo, hi in ring.owned if hi > lo]
        else:
            parts = [grads] if dp_rank == 0 else []
        for g in parts:
            g = host_array(g)
            total += float(np.dot(g, g))
    return total


def global_norm(world: MPI.Comm, stages: dict, rings: dict, dp_rank: int) -> float:
    """Collective over `world`: the l2 norm of the whole model's reduced gradient."""
    mine = np.array([owned_sum_of_squares(stages, rings, dp_rank)], np.float64)
    every = np.empty(world.Get_size(), np.float64)
    world.Allgather(mine, every)
    return math.sqrt(math.fsum(every.tolist()))


def scale(stages: dict, rings: dict, coef: float) -> None:
    """The reduced gradients (the parts the optimizer reads) times coef, in float32."""
    f = np.float32(coef)
    for s, st in stages.items():
        ring = rings[s]
        if ring.sharded:
            for lo, hi in ring.owned:
                st.flat_grads[lo:hi] *= f
        else:
            st.flat_grads *= f
