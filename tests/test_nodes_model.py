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


@pytest.mark.parametrize(
    "ring, nodes, ways",
    [
        ("auto", [0, 0, 1, 1], [2, 2, 2, 2]),  # two-level: a node's ranks share its chunks
        ("auto", [0, 0, 0, 1], [3, 3, 3, 1]),  # the node of one rank owns the whole vector
        ("auto", [0, 1, 0, 1], [2, 2, 2, 2]),
        ("flat", [0, 0, 1, 1], [4, 4, 4, 4]),
        ("auto", [0, 1, 2, 3], [4, 4, 4, 4]),  # one rank a node: the flat ring
        ("auto", [0, 0, 0, 0], [4, 4, 4, 4]),
        ("auto", None, [4, 4, 4, 4]),
    ],
)
def test_the_sharded_optimizer_holds_what_its_ring_gives_it(ring, nodes, ways):
    """train.shard_optimizer under the two-level ring: a rank updates its node's chunk, 1 / (the
    group's ranks on its node) of the vector (comm.hier_ring), not 1 / dp; the memory check and
    predict count that."""
    from mpihybrid.train.memory import rank_estimate, shard_ways

    job = _job("grid.pp=1", "grid.dp=4", "train.global_batch=16", "train.shard_optimizer=true",
               f"comm.ring={ring}")  # fmt: skip
    assert [shard_ways(job, 0, r, nodes) for r in range(4)] == ways
    params = predict(job, LOCAL)["memory"][0]["params"]
    for w in set(ways):
        state = rank_estimate(job, 0, ways=w)["optimizer state"]
        assert state == 4 * 2 * -(-params // w)  # AdamW: two moments of the owned chunk
    if nodes == [0, 0, 0, 1]:  # predict: the rank that updates most, on the node of one
        got = predict(job, _nodes(3))["memory"][0]["parts"]["optimizer state"]
        assert got == rank_estimate(job, 0, ways=1)["optimizer state"]


def test_the_two_level_ring_is_where_the_memory_check_looks():
    """pp=2 x dp=2 data-inner on nodes of 2: each stage's group inside one node (the flat ring,
    1/dp); pipeline-inner: one rank a node (the flat ring too); pp=1 x dp=4 on nodes of 2: 1/2."""
    from mpihybrid.train.memory import shard_ways

    pipe = _job("grid.pp=2", "grid.dp=2", "grid.order=data-inner", "train.shard_optimizer=true")
    assert [shard_ways(pipe, p, r, [0, 0, 1, 1]) for p, r in ((0, 0), (1, 3))] == [2, 2]
    inner = _job("grid.pp=2", "grid.dp=2", "grid.order=pipeline-inner",
                 "train.shard_optimizer=true")  # fmt: skip
    assert shard_ways(inner, 0, 0, [0, 0, 1, 1]) == 2
    wide = _job("grid.pp=1", "grid.dp=4", "train.global_batch=16", "train.shard_optimizer=true")
    assert predict(wide, _nodes(2))["memory"][0]["parts"]["optimizer state"] == (
        8 * -(-predict(wide, LOCAL)["memory"][0]["params"] // 2)
    )


# Last session's sitting on benchmarks/two_nodes.sh (docs/communication.md, "Across nodes"):
# (job, its --set, ranks a node, link, this, that, measured this / that)
GPT = ("jobs/gpt_bench.toml", "train.global_batch=16")
PP2 = (*GPT, "grid.pp=2", "grid.dp=2")
DP4 = (*GPT, "grid.pp=1", "grid.dp=4")
WIRE = ("jobs/gpt_wire.toml",)
MEASURED = [
    (WIRE, 2, 2e9, "comm.p2p_codec=bf16", "comm.p2p_codec=fp32", 0.995),
    (WIRE, 2, 2e9, "comm.p2p_codec=int8", "comm.p2p_codec=fp32", 1.002),
    (WIRE, 2, 5e8, "comm.p2p_codec=bf16", "comm.p2p_codec=fp32", 1.049),
    (WIRE, 2, 5e8, "comm.p2p_codec=int8", "comm.p2p_codec=fp32", 1.086),
    (WIRE, 2, 2e8, "comm.p2p_codec=bf16", "comm.p2p_codec=fp32", 1.079),
    (WIRE, 2, 2e8, "comm.p2p_codec=int8", "comm.p2p_codec=fp32", 1.072),
    (WIRE, 2, 1e8, "comm.p2p_codec=bf16", "comm.p2p_codec=fp32", 1.242),
    (WIRE, 2, 1e8, "comm.p2p_codec=int8", "comm.p2p_codec=fp32", 1.162),
    (WIRE, 2, 5e7, "comm.p2p_codec=bf16", "comm.p2p_codec=fp32", 1.490),
    (WIRE, 2, 5e7, "comm.p2p_codec=int8", "comm.p2p_codec=fp32", 1.540),
    ((*PP2, "grid.order=data-inner"), 2, 5e8, "comm.p2p_codec=int8", "comm.p2p_codec=fp32", 0.975),
    (DP4, 2, 5e8, "comm.ring=hierarchical", "comm.ring=flat", 1.150),
    (DP4, 2, 2e9, "comm.ring=hierarchical", "comm.ring=flat", 1.056),
    ((*DP4, "comm.codec=int8"), 2, 5e8, "comm.ring=hierarchical", "comm.ring=flat", 1.040),
    (DP4, 2, 1e8, "comm.ring=hierarchical", "comm.ring=flat", 1.419),
    (PP2, 2, 5e8, "grid.order=pipeline-inner", "grid.order=data-inner", 0.650),
    ((*GPT[:1], "grid.pp=1", "grid.dp=2"), 1, 2e9, "comm.codec=int8", "comm.codec=fp32", 1.379),
]
# what that sitting's ranks got of the machine, a node's two ranks together (a node of one
# rank: half of it, a rank's share): the throughput measured with the link out of the way
# (gpt_wire at 20 Gbit/s, 9,311 tokens/s; gpt_bench pp=2 x dp=2 data-inner at 500 Mbit/s,
# 1,303, where its link is 2 % of the step) over what predict says with a core a node
SITTING_CORES = {"jobs/gpt_wire.toml": 0.65, "jobs/gpt_bench.toml": 0.51}
TIE = 0.05  # a pair measured within this of 1 ranks neither first (that sitting's noise: wider)


@pytest.mark.parametrize("job, per_node, rate, this, that, measured", MEASURED)
def test_predict_ranks_the_sittings_pairs_as_measured(job, per_node, rate, this, that, measured):
    """benchmarks/two_nodes_predict.py's harness (the sitting's cores, the link's token bucket
    of tbf's 256 KiB burst): every pair measured beyond TIE of 1 predicted on that side, and
    every pair within 1.35x of its measured ratio (the model used to say 1.41 where 1.07 was
    measured, 0.35 where 0.65 was: it ran the harness's compute at the cluster file's full
    speed and every message at the link's rate, where a token bucket passes its burst at once)."""
    from mpihybrid.predict.cluster import two_nodes

    cores = SITTING_CORES[job[0]] / (2 if per_node == 1 else 1)
    on = two_nodes(LOCAL, rate, per_node, cores, burst_bytes=256 * 1024)
    a, b = (
        predict(load_job(job[0], [*job[1:], s], 2 * per_node), on)["throughput"]
        for s in (this, that)
    )
    predicted = a / b
    if abs(measured - 1) > TIE:
        assert (predicted > 1) == (measured > 1), predicted
    assert 1 / 1.35 <= predicted / measured <= 1.35, predicted


# The quiet sitting of 2026-11-26 (00:48-01:11 UTC, autogroup off, only nice-19 work beside it):
# the pipeline wire of jobs/gpt_wire.toml where activations bind, and the two lossy wires against
# each other directly (two_nodes_sitting.sh wire_slow, wire_order: 4 pairs each). The loaded
# sittings before it put bf16 above int8 (1.24 against 1.16 at 100 Mbit/s); quiet, int8 gains a
# little more against fp32 and the direct pairs tie within their spread (0.86-1.14).
# (link, this, that, measured this / that)
QUIET = [
    (1e8, "comm.p2p_codec=bf16", "comm.p2p_codec=fp32", 1.244),
    (1e8, "comm.p2p_codec=int8", "comm.p2p_codec=fp32", 1.327),
    (5e7, "comm.p2p_codec=bf16", "comm.p2p_codec=fp32", 1.844),
    (5e7, "comm.p2p_codec=int8", "comm.p2p_codec=fp32", 1.971),
    (1e8, "comm.p2p_codec=int8", "comm.p2p_codec=bf16", 0.965),
    (5e7, "comm.p2p_codec=int8", "comm.p2p_codec=bf16", 1.009),
]
# gpt_wire at 20 Gbit/s in that sitting (a trace, steps 2-7): 9,570 tokens/s, over the 14,272
# predict says on a core a node
QUIET_CORES = 0.67


@pytest.mark.parametrize("rate, this, that, measured", QUIET)
def test_predict_ranks_the_lossy_wires_as_the_quiet_sitting_did(rate, this, that, measured):
    """Every pair of the quiet sitting measured beyond TIE of 1 predicted on that side, and within
    1.35x of its measured ratio, int8 / bf16 too (predicted 1.12 and 1.30: int8's 130 KiB
    messages pass inside tbf's 256 KiB burst, bf16's 256 KiB ones half in it; the sitting's
    traces at 50 Mbit/s: median transit 4.7 ms against 26.3, steps 427 against 507 ms)."""
    from mpihybrid.predict.cluster import two_nodes

    on = two_nodes(LOCAL, rate, 2, QUIET_CORES, burst_bytes=256 * 1024)
    a, b = (predict(load_job("jobs/gpt_wire.toml", [s], 4), on)["throughput"] for s in (this, that))
    predicted = a / b
    if abs(measured - 1) > TIE:
        assert (predicted > 1) == (measured > 1), predicted
    assert 1 / 1.35 <= predicted / measured <= 1.35, predicted


@pytest.mark.parametrize(
    "setting, message",
    [
        ("comm.p2p_codec=int4", "comm.p2p_codec = 'int4': unknown"),
        ("comm.p2p_codec_scope=rack", "comm.p2p_codec_scope = 'rack': unknown"),
        ("comm.ring=tree", "comm.ring = 'tree': unknown"),
        ("grid.order=diagonal", "grid.order = 'diagonal'"),
    ],
)
def test_a_bad_wire_or_ring_setting_is_one_config_error(setting, message):
    """Before any rank sends anything (config validation: the same line on every rank, exit 2
    in the CLI as for comm.codec, tests/test_bad_input.py)."""
    from mpihybrid.config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
        _job("grid.pp=2", "grid.dp=2", setting)
    assert "\n" not in str(info.value)


def test_auto_order_is_resolved_once_and_an_explicit_order_wins(monkeypatch):
    """predict.auto.resolve_order as training calls it (rank 0 chooses, everyone gets it): the
    order predict ranks first on the nodes MPI reports, and the line rank 0 prints and the
    trace keeps; an explicit order stays, with no line; no node map: pipeline-inner, saying
    why."""
    from mpi4py import MPI

    from mpihybrid.predict import auto

    monkeypatch.setattr(auto, "node_map", lambda world: [0, 0, 1, 1])
    job, line = auto.resolve_order(_job("grid.pp=2", "grid.dp=2", "grid.order=auto"), MPI.COMM_SELF)
    best, _ = choose_order(_job("grid.pp=2", "grid.dp=2"), [0, 0, 1, 1], LOCAL)
    assert job.grid.order == best and line.startswith(f"grid.order = auto: {best}")
    assert "on 2 nodes of 2/2 ranks" in line
    explicit = _job("grid.pp=2", "grid.dp=2", "grid.order=pipeline-inner")
    assert auto.resolve_order(explicit, MPI.COMM_SELF) == (explicit, "")
    monkeypatch.setattr(auto, "node_map", lambda world: None)
    job, line = auto.resolve_order(_job("grid.pp=2", "grid.dp=2", "grid.order=auto"), MPI.COMM_SELF)
    assert job.grid.order == "pipeline-inner" and "MPI cannot say" in line


def test_the_trace_keeps_the_order_choice_and_the_ring():
    """train(notes=...) -> tracing.note_ring: the line auto printed and which ring ran, as
    attributes of rank 0's trace (collective over the world: one rank here)."""
    from types import SimpleNamespace

    from mpi4py import MPI

    from mpihybrid.train.tracing import note_ring

    line = "grid.order = auto: data-inner (predicted 2 against 1 for pipeline-inner, ...)"
    for groups, ring in ((None, "flat"), (object(), "hierarchical")):
        writer = SimpleNamespace(attrs={})
        run = SimpleNamespace(gradcomm=SimpleNamespace(groups=groups),
                              trace=SimpleNamespace(writer=writer))  # fmt: skip
        note_ring(MPI.COMM_SELF, run, {"order_choice": line})
        assert writer.attrs == {"order_choice": line, "ring": ring}
