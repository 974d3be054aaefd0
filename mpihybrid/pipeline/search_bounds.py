"""Lower bounds on a step's time that hold for every order, so a search can say how far the best
it found can be from the best there is.

    busiest_work(costs, placement, ranges, m)   # the busiest rank's own F + B + W, m times
    fill_bound(costs, placement, ranges, m)     # that, plus the wait for its first input
    any_placement_bound(costs, pp, m)           # fill_bound's least over every block-to-rank map

The fill: no rank can run a stage's work before a micro-batch's forward has come through every
block ahead of it (their F, one after the other, a hop at each change of rank). So for every
rank r and every stage s it holds, all of r's work on s and on its later stages (m micro-batches
of F, B and W) comes after that release: the step is at least release(s) + that work. This holds
whatever the order (FIFO or not) and the memory limit, since it only uses the dependencies.
any_placement_bound takes the least over every assignment of the blocks to pp ranks (a stage is
a run of consecutive blocks on one rank: loop, V, interleaved or any other), so no schedule of
these whole blocks on pp ranks ends sooner.
"""

from __future__ import annotations

import itertools

from mpihybrid.pipeline.placement import Placement

MAX_ASSIGNMENTS = 50_000  # block-to-rank maps any_placement_bound enumerates (else None)


def busiest_work(costs, placement: Placement, ranges: list[range], m: int) -> float:
    """The busiest rank's own work at this split: F + B + W of its stages, m times."""
    load = [0.0] * placement.pp
    for s, r in enumerate(ranges):
        load[placement.rank_of(s)] += m * sum(costs.total(i) for i in r)
    return max(load)


def _rank_bound(owner: list[int], costs, m: int, pp: int) -> float:
    """The fill bound of one block-to-rank map (owner[i]: the rank of block i)."""
    n = len(owner)
    later = [0.0] * pp  # each rank's work on blocks >= i, filled from the last block back
    release = [0.0] * n
    t = 0.0
    for i in range(n):
        release[i] = t
        t += costs.forward[i] + (costs.send if i + 1 < n and owner[i + 1] != owner[i] else 0.0)
    bound = 0.0
    for i in range(n - 1, -1, -1):
        later[owner[i]] += m * costs.total(i)
        if i == 0 or owner[i - 1] != owner[i]:  # a stage starts here
            bound = max(bound, release[i] + later[owner[i]])
    return bound


def fill_bound(costs, placement: Placement, ranges: list[range], m: int) -> float:
    """The least step any order of this placement and split can reach (module text)."""
    owner = [placement.rank_of(s) for s, r in enumerate(ranges) for _ in r]
    return _rank_bound(owner, costs, m, placement.pp)


def any_placement_bound(costs, pp: int, m: int) -> float | None:
    """The fill bound's least over every map of the blocks to pp ranks; None where there are
    more than MAX_ASSIGNMENTS maps (or the costs are a trace's fixed stages)."""
    n = costs.units
    if costs.fixed or pp ** (n - 1) > MAX_ASSIGNMENTS:
        return None
    best = float("inf")
    for rest in itertools.product(range(pp), repeat=n - 1):  # block 0 on rank 0: symmetry
        best = min(best, _rank_bound([0, *rest], costs, m, pp))
    return best
