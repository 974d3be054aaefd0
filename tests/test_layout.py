"""Where a rank sits (comm/layout.py): both orders by their formulas, every rank round trip, the
pipelines and replica groups partitioning the world."""

from __future__ import annotations

import itertools

import pytest

from mpihybrid.comm.layout import ORDERS, Layout
from mpihybrid.config import load_job

SHAPES = [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2), (3, 5)]


@pytest.mark.parametrize("pp,dp", SHAPES)
@pytest.mark.parametrize("order", ORDERS)
def test_round_trip(pp, dp, order):
    layout = Layout(pp, dp, order)
    ranks = [layout.rank(p, d) for p, d in itertools.product(range(pp), range(dp))]
    assert sorted(ranks) == list(range(pp * dp))  # a bijection onto the world
    for r in range(pp * dp):
        assert layout.rank(*layout.coords(r)) == r


def test_the_orders_formulas():
    inner = Layout(3, 2, "pipeline-inner")  # a pipeline's stages are consecutive ranks
    assert [inner.coords(r) for r in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert inner.pipeline_ranks(1) == [3, 4, 5] and inner.replica_ranks(2) == [2, 5]
    data = Layout(3, 2, "data-inner")  # a stage's replicas are consecutive ranks
    assert [data.coords(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert data.pipeline_ranks(1) == [1, 3, 5] and data.replica_ranks(2) == [4, 5]


@pytest.mark.parametrize("order", ORDERS)
def test_groups_partition_the_world(order):
    layout = Layout(3, 4, order)
    pipelines = [layout.pipeline_ranks(d) for d in range(4)]
    replicas = [layout.replica_ranks(p) for p in range(3)]
    assert sorted(sum(pipelines, [])) == sorted(sum(replicas, [])) == list(range(12))
    for p, d in itertools.product(range(3), range(4)):  # each rank is in one of each
        assert pipelines[d][p] == replicas[p][d] == layout.rank(p, d)


def test_bad_layouts_say_why():
    with pytest.raises(ValueError, match="grid order 'diagonal'"):
        Layout(2, 2, "diagonal")
    with pytest.raises(ValueError, match="at least 1"):
        Layout(2, 0)
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        Layout(2, 2).coords(4)
    with pytest.raises(ValueError, match="outside 2 x 2"):
        Layout(2, 2).rank(2, 0)


def test_a_resolved_job_answers_its_layout():
    job = load_job(None, ["grid.pp=2", "grid.dp=-1", "grid.order=data-inner"], 6)
    assert job.grid.layout == Layout(2, 3, "data-inner")
