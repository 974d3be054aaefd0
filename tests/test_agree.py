"""The one first-error agreement (comm/agree.py), with a world that gathers what it is told."""

from __future__ import annotations

import textwrap

import pytest

from mpihybrid.comm.agree import agree, first_error, rank0_decides
from tests.helpers import results, run_mpi


class World:
    """allgather as MPI's: every rank's value, in rank order (here: the ranks' given values);
    bcast as rank 0's: what rank 0 sent (`sent`, or this process's own as rank 0)."""

    def __init__(self, values, rank=0, sent=None):
        self.values, self.rank, self.sent = values, rank, sent

    def bcast(self, mine, root=0):
        assert root == 0
        return mine if self.rank == 0 else self.sent

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


def test_rank0_decides_gives_its_value_or_its_errors_first_line():
    world = World([])
    assert rank0_decides(world, lambda: {"order": "data-inner"}) == ({"order": "data-inner"}, None)

    def full():
        raise OSError("no space left\n(details a user does not need)")

    assert rank0_decides(world, full) == (None, "no space left")
    assert rank0_decides(None, full, describe=lambda e: f"said: {e.args[0][:8]}") == (
        None,
        "said: no space",
    )
    with pytest.raises(OSError):  # not expected: raised on rank 0 (the caller ends the job)
        rank0_decides(world, full, expected=(ValueError,))
    # another rank does not decide: it takes rank 0's answer
    other = World([], rank=1, sent=(None, "no space left"))
    assert rank0_decides(other, lambda: 1 / 0) == (None, "no space left")


AGREE_RUN = textwrap.dedent(
    """
    import json
    from mpi4py import MPI
    from mpihybrid.comm.agree import rank0_decides

    world = MPI.COMM_WORLD

    def measured():
        assert world.rank == 0, "only rank 0 decides"
        return [3, 4, 2]

    def refused():
        assert world.rank == 0, "only rank 0 decides"
        raise ValueError("rank 0's file is damaged\\nTraceback-like detail")

    out = {"rank": world.rank, "value": rank0_decides(world, measured)}
    out["error"] = rank0_decides(world, refused)
    rows = world.gather(out, root=0)  # one writer: ranks' lines would interleave
    if world.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    """
)


@pytest.mark.mpi
def test_rank0_decides_reaches_every_rank_alike():
    (rows,) = results(run_mpi(3, "-c", AGREE_RUN, timeout=60))
    assert sorted(r["rank"] for r in rows) == [0, 1, 2]
    for r in rows:
        assert r["value"] == [[3, 4, 2], None]
        assert r["error"] == [None, "rank 0's file is damaged"]
