"""The one first-error agreement (comm/agree.py), with a world that gathers what it is told."""

from __future__ import annotations

from mpihybrid.comm.agree import agree, first_error


class World:
    """allgather as MPI's: every rank's value, in rank order (here: the ranks' given values)."""

    def __init__(self, values):
        self.values = values

    def allgather(self, mine):
        return [mine if v is self else v for v in self.values]


def test_the_lowest_ranks_error_wins_on_every_rank():
    ranks = [(None, True), ("disk full", False), ("bad file", True)]
    world = World([None] * 3)
    world.values = [world, *ranks[1:]]  # this process is rank 0, the others answered already
    found, answers = agree(world, *ranks[0])
    assert found == [(1, "disk full"), (2, "bad file")]
    assert answers == [True, False, True]
    world.values = [(None, None), ("late", None), ("later", None), world]
    assert first_error(world, None) == "late"
    world.values = [(None, None), world]
    assert first_error(world, None) is None
