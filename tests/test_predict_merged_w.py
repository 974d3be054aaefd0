"""predict's merged W (train.merge_w): one GEMM per Linear over the group's rows after their
gather, costed from the device's rates (predict/model.merged_weight_seconds)."""

from __future__ import annotations

import dataclasses

import pytest

from mpihybrid.nn.cost import ChunkWork, stage_work
from mpihybrid.nn.layers import Cost
from mpihybrid.predict.cluster import load_cluster
from mpihybrid.predict.model import (
    action_seconds,
    gemm_seconds,
    merged_weight_more,
    merged_weight_seconds,
    predict,
)
from tests.helpers import ROOT
from tests.test_predict import _job

LOCAL = load_cluster(ROOT / "clusters" / "local.toml")


def _chunk(*layers: Cost) -> ChunkWork:
    return ChunkWork(list(layers), params=0, activation_bytes=0, input_bytes=0, largest_temporary=0)


def test_a_merged_linear_by_hand():
    """One Linear of 64 -> 32 on 16 rows, 3 micro-batches merged: its GEMM over 48 rows, one
    call, the gather of x and dy read and written, the bias's row sums three times."""
    linear = Cost(params=64 * 32 + 32)
    linear.gemms["W"] = [(1, 64, 16, 32)]
    linear.elem_bytes["W"] = 4 * 16 * 32
    linear.calls["W"] = 1
    linear.merge_row_bytes = 4 * (64 + 32)
    d = LOCAL.device
    want = (
        gemm_seconds((1, 64, 48, 32), d)
        + 2 * 4 * 48 * (64 + 32) / d.mem_bandwidth
        + 3 * 4 * 16 * 32 / d.mem_bandwidth
        + d.op_overhead_s
    )
    assert merged_weight_seconds(_chunk(linear), 3, LOCAL) == pytest.approx(want, rel=1e-12)
    assert merged_weight_seconds(_chunk(linear), 1, LOCAL) == action_seconds(
        _chunk(linear), "W", LOCAL
    )


def test_layers_that_gather_nothing_cost_their_members():
    """A norm's W (no GEMM) and a GEMM without a gather run once per micro-batch."""
    norm = Cost(params=8)
    norm.elem_bytes["W"], norm.calls["W"] = 96.0, 1
    plain = Cost(params=16)
    plain.gemms["W"], plain.calls["W"] = [(1, 4, 8, 4)], 1
    work = _chunk(norm, plain)
    assert merged_weight_seconds(work, 4, LOCAL) == pytest.approx(
        4 * action_seconds(work, "W", LOCAL), rel=1e-12
    )


def test_a_merged_w_saves_calls_and_the_gradients_traffic_and_pays_the_gather():
    """On gpt_bench's chunks of blocks a merged W of 8 costs less than 8 W, by less than their
    Linears' calls and gradient traffic (the gather pays some of it back); the head's chunk
    gathers 10,000-wide gradient rows and pays more than it saves; a device with free calls and
    no GEMM traffic gains nothing and pays the gather."""
    job = _job("jobs/gpt_bench.toml", "train.schedule=zb-v", "train.merge_w=8")
    work = stage_work(job.workload)
    more = merged_weight_more(job, work, LOCAL)
    assert more is not None and len(more) == len(work)
    for w, extra in zip(work, more, strict=True):
        one = action_seconds(w, "W", LOCAL)
        head = any(g[3] == job.data.vocab for g in w.gemms("W"))
        assert (one < extra < 1.1 * one) if head else (0.5 * one < extra < one)
    free = dataclasses.replace(LOCAL.device, op_overhead_s=0.0, gemm_call_s=0.0, gemm_bandwidth=0)
    free = dataclasses.replace(LOCAL, device=free)
    for w, extra in zip(work, merged_weight_more(job, work, free), strict=True):
        assert extra > action_seconds(w, "W", free)
    unmerged = _job("jobs/gpt_bench.toml", "train.schedule=zb-v")
    assert merged_weight_more(unmerged, work, LOCAL) is None


def test_predict_costs_the_merge_it_is_given():
    """predict of a zero-bubble job at M = 8 moves with train.merge_w and its chunks' costs;
    1F1B sending after whole backwards has no W to merge."""

    def step(*sets, cluster=LOCAL):
        job = _job("jobs/gpt_bench.toml", "train.microbatches=8", *sets)
        return predict(job, cluster)["step_time_s"]

    unmerged, merged = step("train.schedule=zb-v"), step("train.schedule=zb-v", "train.merge_w=8")
    assert merged < unmerged
    # with calls for nothing the gather costs more than the gradients' traffic it saves: on
    # this device what a merge buys is the calls of the Linears' W
    free = dataclasses.replace(LOCAL, device=dataclasses.replace(LOCAL.device, op_overhead_s=0.0))
    saved = step("train.schedule=zb-v", cluster=free) - step(
        "train.schedule=zb-v", "train.merge_w=8", cluster=free
    )
    assert saved < 0
    plain = ("train.schedule=1f1b", "train.early_grad_send=false")
    assert step(*plain, "train.merge_w=8") == step(*plain)
