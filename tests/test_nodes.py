"""Across nodes (issue #40): codecs on the pipeline wire, the two-level ring, the layout choice.

Nodes are named per rank with MPIHYBRID_NODES (comm.nodes), so one machine plays several; the
two-node harness (benchmarks/two_nodes.sh, root) is tested in test_two_nodes.py."""

from __future__ import annotations

import pytest

from tests.helpers import results, run_mpi

pytestmark = pytest.mark.mpi

TINY = ["train.steps=4", "train.microbatches=4", "train.global_batch=32", "model.hidden=32",
        "model.depth=4", "comm.bucket_kb=1"]  # fmt: skip


def _variants(n: int, nodes: str, base: list[str], variants: list[str], stderr: list | None = None):
    argv = ["tests/_mpi_nodes.py"]
    for item in TINY + base:
        argv += ["--set", item]
    for v in variants:
        argv += ["--variant", v]
    proc = run_mpi(n, *argv, timeout=240, env={"MPIHYBRID_NODES": nodes})
    if stderr is not None:
        stderr.append(proc.stderr)
    return {r["name"]: r for r in results(proc)}


def test_p2p_codec_fp32_is_today_and_lossy_is_deterministic():
    # pipeline-inner pp=2 x dp=2: every pipeline's two stages on two nodes
    runs = _variants(4, "0,1,0,1", ["grid.pp=2", "grid.dp=2"], [
        "base", "fp32-all:comm.p2p_codec_scope=all",
        "bf16:comm.p2p_codec=bf16", "bf16-again:comm.p2p_codec=bf16",
        "bf16-all:comm.p2p_codec=bf16;comm.p2p_codec_scope=all",
        "int8:comm.p2p_codec=int8", "fp16:comm.p2p_codec=fp16",
        # data-inner: each pipeline inside one node, so inter-node encodes nothing
        "di:grid.order=data-inner", "di-bf16:grid.order=data-inner;comm.p2p_codec=bf16",
    ])  # fmt: skip
    base = runs["base"]
    for r in runs.values():
        assert r["replica_max_diff"] == 0.0, r
    assert runs["fp32-all"]["sha"] == base["sha"]
    assert runs["fp32-all"]["bytes_sent"] == base["bytes_sent"]
    assert runs["di-bf16"]["sha"] == runs["di"]["sha"]  # no link crosses a node
    assert runs["di-bf16"]["bytes_sent"] == runs["di"]["bytes_sent"]
    assert runs["bf16"]["sha"] == runs["bf16-again"]["sha"] == runs["bf16-all"]["sha"]
    assert runs["bf16"]["sha"] != base["sha"]  # the wire really was bf16
    act = base["bytes_sent"]["activation"], base["bytes_sent"]["activation_grad"]
    for name, ratio in (("bf16", 1 / 2), ("fp16", 1 / 2), ("int8", (32 + 4) / (4 * 32))):
        sent = runs[name]["bytes_sent"]
        assert (sent["activation"], sent["activation_grad"]) == (act[0] * ratio, act[1] * ratio)
        # the same gradient ring; training close to fp32's
        ring = ("reduce_scatter", "all_gather")
        assert [sent[k] for k in ring] == [base["bytes_sent"][k] for k in ring]
        for a, b in zip(runs[name]["losses"], base["losses"], strict=True):
            assert abs(a - b) <= 0.02 * abs(b), (name, runs[name]["losses"], base["losses"])


# the largest error against the exact mean, relative to its largest magnitude, after three calls
TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2, "int8": 6e-2}


@pytest.mark.parametrize("nodes", ["0,1", "0,0,1", "0,1,1,1", "0,1,0,0"])
def test_two_level_ring_equals_the_flat_ring(nodes):
    n = len(nodes.split(","))
    cases = results(run_mpi(n, "tests/_mpi_hier.py", nodes, timeout=120))
    assert len(cases) == 12
    for r in cases:
        assert r["identical"] and r["flat_identical"] and r["gather_identical"], r
        tol = TOLERANCE[r["codec"]]
        assert r["two_vs_exact"] <= tol and r["rs_err"] <= tol, r
        if r["codec"] == "fp32":  # to float summation order
            assert r["flat_vs_two"] <= 1e-6 and r["gather_err"] == 0.0, r
        else:
            assert r["gather_err"] <= tol, r
        assert r["inter_bytes"] > 0 or r["count"] < 2, r


def test_two_level_training_keeps_replicas_identical():
    """pp=1 x dp=4 with 3 ranks on node 0 and 1 on node 1 (comm.ring auto: two-level): fp32
    equals the flat ring to summation order; int8, and the sharded optimizer gathering int8
    weights, keep every replica bit-identical; then pp=2 x dp=2 asking for hierarchical where
    no stage's replicas can use it: one warning line, the flat ring."""
    err: list[str] = []
    runs = _variants(4, "0,0,0,1", ["grid.pp=1", "grid.dp=4", "train.optimizer=adamw",
                                    "train.lr=0.003"], [
        "flat:comm.ring=flat", "two", "two-int8:comm.codec=int8",
        "two-int8-again:comm.codec=int8", "flat-int8:comm.ring=flat;comm.codec=int8",
        "zero:comm.codec=int8;train.shard_optimizer=true;comm.param_codec=int8",
        "warned:grid.pp=2;grid.dp=2;comm.ring=hierarchical",
    ], err)  # fmt: skip
    for r in runs.values():
        assert r["replica_max_diff"] == 0.0, r
    assert runs["two"]["max_diff_first"] <= 1e-5, runs["two"]  # fp32: summation order only
    assert runs["two"]["bytes_sent"]["inter_node"] > 0
    assert "inter_node" not in runs["flat"]["bytes_sent"]
    assert runs["two-int8"]["sha"] == runs["two-int8-again"]["sha"]
    # across the link: the flat ring's crossing hops (ranks 2 and 3 send half of its bytes)
    # against the two-level ring's one ring across, two thirds of them
    two, flat = runs["two-int8"]["bytes_sent"], runs["flat-int8"]["bytes_sent"]
    crossing = (flat["reduce_scatter"] + flat["all_gather"]) / 2
    assert 0 < two["inter_node"] <= 0.7 * crossing, (two, flat)
    for name in ("two-int8", "zero"):
        for a, b in zip(runs[name]["losses"], runs["flat"]["losses"], strict=True):
            assert abs(a - b) <= 0.03 * abs(b), (name, runs[name]["losses"])
    warnings = [x for x in err[0].splitlines() if "comm.ring = 'hierarchical'" in x]
    assert len(warnings) == 1, err[0]
