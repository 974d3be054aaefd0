"""Across nodes without MPI: which ring a dp group gets, the two-level ring's pieces, what
predict says of the pipeline wire's codec, the two-level ring and grid.order = auto."""

from __future__ import annotations

import dataclasses

import pytest

from mpihybrid.comm.buckets import ring_kind
from mpihybrid.config import load_job
from mpihybrid.pipeline.wire import P2PWire, encoded_peers
from mpihybrid.predict.auto import choose_order
from mpihybrid.predict.cluster import find_cluster, load_cluster
from mpihybrid.predict.model import predict
from mpihybrid.predict.wire import ring_seconds

LOCAL = load_cluster(find_cluster("local"))


def _job(*sets: str, world: int = 4):
    return load_job("jobs/gpt_bench.toml", list(sets), world)


def _nodes(per_node: int, **links):
    node = dataclasses.replace(LOCAL.node, ranks_per_node=per_node, cores=0)
    return dataclasses.replace(LOCAL, node=node)


@pytest.mark.parametrize(
    "setting, nodes, kind, warned",
    [
        ("auto", [0, 0, 1, 1], "hierarchical", False),
        ("auto", [0, 1], "flat", False),  # one replica a node: nothing to do inside
        ("auto", [0, 0], "flat", False),
        ("auto", None, "flat", False),
        ("flat", [0, 0, 1], "flat", False),
        ("hierarchical", [0, 0, 1], "hierarchical", False),
        ("hierarchical", [0, 0], "flat", True),
        ("hierarchical", None, "flat", True),
    ],
)
def test_which_ring_a_group_gets(setting, nodes, kind, warned):
    got, warning = ring_kind(setting, nodes)
    assert got == kind and bool(warning) == warned
    assert "\n" not in warning


def test_the_pipeline_wire_encodes_the_links_that_cross():
    nodes = [0, 0, 1, 1]
    assert encoded_peers("inter-node", 1, [0, 1, 2, 3], nodes) == {2, 3}
    assert encoded_peers("all", 1, [0, 1, 2, 3], nodes) == {0, 2, 3}
    assert encoded_peers("inter-node", 1, [0, 1], None) == set()
    assert P2PWire.build("fp32", {1}).encoded_peers == frozenset()
    int8 = P2PWire.build("int8", {1}).codec_for((4, 64, 96))
    assert int8.nbytes(4 * 64 * 96) == 4 * 64 * (96 + 4)  # one float32 scale per row


def test_predict_counts_the_wire_codec_where_links_cross():
    """data-inner pp=2 x dp=2 on nodes of 2: every pipeline link crosses; bf16 halves the
    message and costs its encode and decode; pipeline-inner keeps the links inside."""
    on = _nodes(2)
    fp32 = predict(_job("grid.pp=2", "grid.dp=2", "grid.order=data-inner"), on)
    bf16 = predict(_job("grid.pp=2", "grid.dp=2", "grid.order=data-inner",
                        "comm.p2p_codec=bf16"), on)  # fmt: skip
    inside = predict(_job("grid.pp=2", "grid.dp=2", "comm.p2p_codec=bf16"), on)
    inside32 = predict(_job("grid.pp=2", "grid.dp=2"), on)
    assert bf16["message_s"] < fp32["message_s"]
    assert inside["message_s"] == inside32["message_s"]


def test_predict_two_level_ring_beats_the_flat_one_across_a_slow_link():
    """pp=1 x dp=4 on two nodes of two at 2 Gbit/s: the two-level ring's time is below the
    flat ring's, which crosses the link with every hop."""
    on = _nodes(2)
    flat = _job("grid.pp=1", "grid.dp=4", "train.global_batch=16", "comm.ring=flat")
    two = _job("grid.pp=1", "grid.dp=4", "train.global_batch=16", "comm.ring=auto")
    params = 10_000_000
    assert ring_seconds(two, 0, params, on)[0] < ring_seconds(flat, 0, params, on)[0] / 1.3
    assert predict(two, on)["job"]["ring"] == "hierarchical"
    assert predict(flat, on)["job"]["ring"] == "flat"


def test_auto_order_is_the_faster_one_and_says_why():
    job = _job("grid.pp=2", "grid.dp=2")
    order, line = choose_order(job, [0, 0, 1, 1], LOCAL)
    rates = {o: predict(_job("grid.pp=2", "grid.dp=2", f"grid.order={o}"), _nodes(2))[
        "throughput"] for o in ("pipeline-inner", "data-inner")}  # fmt: skip
    assert order == max(rates, key=rates.get) and order in line and "\n" not in line
    assert choose_order(job, None, LOCAL) == (
        "pipeline-inner", "grid.order = auto: MPI cannot say which ranks share a node: "
        "pipeline-inner")  # fmt: skip
    auto = predict(_job("grid.pp=2", "grid.dp=2", "grid.order=auto"), _nodes(2))
    assert auto["job"]["order"] == order
