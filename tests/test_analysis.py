"""Trace analysis: numbers against the events of a real run, the bubble on synthetic traces."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from mpihybrid.analysis.costs import stage_costs
from mpihybrid.analysis.messages import match_messages, message_latency
from mpihybrid.analysis.metrics import analyze, bubble_summary
from mpihybrid.analysis.report import format_analysis
from mpihybrid.config import load_job
from mpihybrid.nn.model import build_stage
from mpihybrid.pipeline.plan import make_schedule
from mpihybrid.pipeline.schedules import Placement, build_schedule, lower, placement_of
from mpihybrid.pipeline.simulate import Costs, bubble_formula, peak_inflight, simulate
from mpihybrid.trace.read import Trace, load
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND
from tests.helpers import ROOT, results, run_mpi

PP, DP, M, STEPS = 2, 2, 4, 3
SCHEDULE = "zb-h1"  # has F, B and W


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One real zb-h1 run (pp=2 x dp=2, 3 steps): its trace, analysis and the ranks' own counts."""
    path = tmp_path_factory.mktemp("analysis") / "run.h5"
    proc = run_mpi(
        PP * DP,
        "tests/_mpi_train.py",
        "--schedules",
        SCHEDULE,
        *("--set", f"grid.pp={PP}", "--set", f"grid.dp={DP}", "--set", f"train.steps={STEPS}"),
        *("--set", f"train.microbatches={M}", "--set", f'trace.path="{path}"'),
        timeout=120,
    )
    counted = results(proc)
    trace = load(path)
    return trace, analyze(trace), counted[0]


def durations(rows: np.ndarray) -> float:
    return float((rows["end"] - rows["start"]).sum())


# --- a real run ----------------------------------------------------------------------------------


@pytest.mark.mpi
def test_time_split_sums_the_events(run):
    trace, result, _ = run
    ev = trace.events[trace.events["step"] >= 1]  # the measured window: step 1 is the warm-up
    assert [r["rank"] for r in result["ranks"]] == list(range(PP * DP))
    for row in result["ranks"]:
        mine = ev[ev["rank"] == row["rank"]]
        for name in ("forward", "backward", "weight", "recv", "send", "allreduce", "optimizer"):
            assert row[name] == pytest.approx(
                durations(mine[mine["kind"] == KIND[name]]), abs=1e-12
            )
        total = durations(mine[mine["kind"] == KIND["step"]])
        assert row["total"] == pytest.approx(total, abs=1e-12)
        # the main thread's work and its wait for the gradient buckets lie inside its steps:
        # the rest is idle and not negative (the buckets' rings and updates may run behind)
        parts = sum(row[n] for n in ("forward", "backward", "weight", "recv", "send"))
        wait = durations(mine[mine["kind"] == KIND["grad_wait"]])
        assert row["exposed_comm"] == pytest.approx(wait, abs=1e-12)
        parts += wait
        assert parts <= total + 1e-9
        assert row["idle"] == pytest.approx(total - parts, abs=1e-9)
        work = row["allreduce"] + row["optimizer"]
        assert row["hidden_comm"] == pytest.approx(max(0.0, work - wait), abs=1e-12)
    for row in result["stages"]:
        f = ev[(ev["kind"] == KIND["forward"]) & (ev["stage"] == row["stage"])]
        assert row["forward"] == pytest.approx(durations(f), abs=1e-12)
        assert row["mean_forward"] > 0 and row["mean_weight"] > 0


@pytest.mark.mpi
def test_bytes_equal_what_the_ranks_counted(run):
    _, result, counted = run
    sent = counted["bytes_sent"]
    assert result["bytes"]["activation"] == sent["activation"] > 0
    assert result["bytes"]["activation_grad"] == sent["activation_grad"] > 0
    assert result["bytes"]["allreduce"] == sent["reduce_scatter"] + sent["all_gather"] > 0
    assert result["bytes"]["unmatched"] == 0


@pytest.mark.mpi
def test_event_counts_are_what_the_schedule_implies(run):
    trace, result, _ = run
    lowered = lower(build_schedule(SCHEDULE, PP, M), Placement.loop(PP))
    per_step = {k: sum(a.kind == k for acts in lowered.values() for a in acts) for k in
                ("F", "B", "W", "SEND_F", "SEND_B", "RECV_F", "RECV_B")}  # fmt: skip
    world = PP * DP
    counts = result["counts"]
    assert counts["forward"] == STEPS * DP * per_step["F"] == STEPS * DP * PP * M
    assert counts["backward"] == STEPS * DP * per_step["B"]
    assert counts["weight"] == STEPS * DP * per_step["W"] == STEPS * DP * PP * M
    assert counts["recv"] == STEPS * DP * (per_step["RECV_F"] + per_step["RECV_B"])
    # plus one row per rank and step: waiting for the step's outstanding sends
    assert counts["send"] == STEPS * DP * (per_step["SEND_F"] + per_step["SEND_B"]) + STEPS * world
    assert counts["allreduce"] == counts["optimizer"] == counts["step"] == STEPS * world
    assert result["messages"]["matched"] == result["messages"]["sends"] == counts["recv"]


@pytest.mark.mpi
def test_messages_pair_sends_with_their_receives(run):
    trace, _, _ = run
    ev = trace.events
    messages = match_messages(ev)
    assert len(messages) == int(np.sum((ev["kind"] == KIND["send"]) & (ev["microbatch"] >= 0)))
    assert len(set(messages.recv.tolist())) == len(messages)
    s, r = ev[messages.send], ev[messages.recv]
    step_of = np.where(messages.direction == "F", 1, -1)
    assert np.array_equal(r["stage"], s["stage"] + step_of)
    assert np.array_equal(r["microbatch"], s["microbatch"]) and np.array_equal(r["step"], s["step"])
    assert np.array_equal(r["bytes"], s["bytes"]) and np.array_equal(r["replica"], s["replica"])
    owner = {(int(e["replica"]), int(e["stage"])): int(e["rank"]) for e in ev if e["stage"] >= 0}
    assert all(owner[(int(e["replica"]), int(e["stage"]))] == e["rank"] for e in r)


@pytest.mark.mpi
def test_peak_activations_match_the_runtime_and_schedule(run):
    _, result, counted = run
    peaks = [s["peak_inflight"] for s in result["stages"]]
    assert peaks == [counted["peak_inflight"][str(s)] for s in range(PP)]
    assert peaks == peak_inflight(build_schedule(SCHEDULE, PP, M), Placement.loop(PP))
    assert all(s["peak_activation_bytes"] > 0 for s in result["stages"])


@pytest.mark.mpi
def test_allreduce_bandwidth_follows_nccl_tests(run):
    trace, result, _ = run
    job = load_job(None, [f"grid.pp={PP}", f"grid.dp={DP}"], PP * DP)
    assert len(result["allreduce"]) == PP
    for a in result["allreduce"]:
        stage = build_stage(job.model, job.data.features, 2, a["stage"], PP, seed=0)
        assert a["size_bytes"] == 4 * stage.num_params
        assert a["algbw"] == pytest.approx(a["size_bytes"] / a["seconds"])
        assert a["busbw"] == pytest.approx(a["algbw"] * 2 * (DP - 1) / DP)
        assert a["wire_bytes"] == a["size_bytes"]  # fp32 ring, 2 ranks: each sends the vector once


@pytest.mark.mpi
def test_step_time_throughput_and_straggler(run):
    trace, result, _ = run
    steps = trace.kind("step")
    per_step = [
        float(steps["end"][steps["step"] == t].max() - steps["start"][steps["step"] == t].min())
        for t in range(STEPS)
    ]
    assert result["step_time"]["per_step"] == pytest.approx(per_step)
    assert result["step_time"]["mean"] == pytest.approx(np.mean(per_step[1:]))
    # the same window: the steps after the first, the default global batch over their time
    assert result["throughput"]["samples"] == (STEPS - 1) * 64
    assert result["throughput"]["samples_per_s"] == pytest.approx(64 / np.mean(per_step[1:]))
    busiest = max(result["ranks"], key=lambda r: r["busy"])
    assert result["straggler"]["rank"] == busiest["rank"] and result["straggler"]["vs_mean"] >= 1


@pytest.mark.mpi
def test_bubble_of_a_real_run_is_a_fraction(run):
    _, result, _ = run
    bubble = result["bubble"]
    assert 0 < bubble["measured"] < 1 and 0 < bubble["predicted"] < 1
    assert bubble["steps"] == [1, 2] and set(bubble["per_rank"]) == set(range(PP * DP))
    assert bubble["formula"] == bubble_formula(SCHEDULE, PP, M)


@pytest.mark.mpi
def test_format_and_json(run):
    _, result, _ = run
    text = format_analysis(result)
    for needle in ("bubble", "time by rank", "time by stage", "all-reduce per stage", "busbw"):
        assert needle in text
    # first, in words: the bubble against the formula, and what set it in this run
    head, why = text.splitlines()[1:3]
    assert head.startswith("in short        bubble ") and f"at pp={PP}, M={M}" in head
    assert f"for {SCHEDULE}" in head and "of each step waiting on each other" in head
    assert why.split(":")[0].strip() in (
        "oversubscribed", "latency bound", "near the formula", "above the formula",
        "below the formula",
    ), why  # fmt: skip
    assert json.loads(json.dumps(result))["bytes"] == result["bytes"]


def test_importable_without_mpi():
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "import mpihybrid.analysis.metrics, mpihybrid.analysis.timeline\n"
        "import mpihybrid.analysis.export, mpihybrid.cli.trace\n"
        "print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.stdout.strip() == "ok", proc.stderr


# --- synthetic traces: the measured bubble is exact ---------------------------------------------


def rows(spec: list[tuple]) -> np.ndarray:
    """(rank, stage, replica, kind, step, mb, start, end) tuples -> event rows."""
    out = np.zeros(len(spec), dtype=EVENT_DTYPE)
    for i, (rank, stage, replica, kind, step, mb, start, end) in enumerate(spec):
        out[i] = (rank, stage, replica, KIND[kind], step, mb, start, end, 0, -1, np.nan)
    return out


def test_measured_bubble_of_known_gaps_is_exact():
    spec = [
        # step 0 is warm-up and must not count: a huge gap on rank 1
        (0, 0, 0, "forward", 0, 0, 0.0, 1.0),
        (1, 1, 0, "forward", 0, 0, 50.0, 51.0),
        # step 1, replica 0: phase 100..104; rank 0 busy 1+1 = 2, rank 1 busy 1+0.5 = 1.5
        (0, 0, 0, "forward", 1, 0, 100.0, 101.0),
        (0, 0, 0, "recv", 1, 0, 101.0, 103.0),  # waiting is idle, not busy
        (1, 1, 0, "forward", 1, 0, 101.5, 102.5),
        (1, 1, 0, "backward", 1, 0, 102.5, 103.0),
        (0, 0, 0, "backward", 1, 0, 103.0, 104.0),
        # step 1, replica 1, later on the clock: its own phase 200..202, no idle on rank 2
        (2, 0, 1, "forward", 1, 0, 200.0, 201.0),
        (2, 0, 1, "backward", 1, 0, 201.0, 202.0),
        (3, 1, 1, "forward", 1, 0, 200.5, 201.0),
        (3, 1, 1, "weight", 1, 0, 201.0, 201.5),
    ]
    result = bubble_summary(rows(spec), make_schedule("1f1b", 2, 1))
    expected = {0: 1 - 2 / 4, 1: 1 - 1.5 / 4, 2: 0.0, 3: 1 - 1.0 / 2}
    assert result["per_rank"] == pytest.approx(expected, abs=1e-12)
    assert result["measured"] == pytest.approx(sum(expected.values()) / 4, abs=1e-12)
    assert result["steps"] == [1]


@pytest.mark.parametrize(
    "name, pp, m, v",
    [("naive", 3, 2, 1), ("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("zb-h1", 3, 6, 1),
     ("interleaved-1f1b", 2, 4, 2)],
)  # fmt: skip
def test_trace_laid_out_by_the_simulator_measures_what_it_predicts(name, pp, m, v):
    # events placed exactly where simulate() puts them: measured == predicted == formula
    actions = build_schedule(name, pp, m, v)
    weight = 1.0 if name == "zb-h1" else 0.0
    placement = placement_of(name, pp, v)
    sim = simulate(actions, placement, Costs(1.0, 1.0, weight))
    code = {"F": "forward", "B": "backward", "W": "weight"}
    spec = []
    for step, origin in ((0, 0.0), (1, 1000.0), (2, 2000.0)):
        for a, t in sim.start.items():
            rank = placement.rank_of(a.stage)
            spec.append((rank, a.stage, 0, code[a.kind], step, a.microbatch, origin + t,
                         origin + sim.end[a]))  # fmt: skip
    events = rows(spec)
    result = bubble_summary(events[np.argsort(events["start"])], make_schedule(name, pp, m, v))
    assert result["measured"] == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert result["predicted"] == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert result["measured"] == pytest.approx(bubble_formula(name, pp, m, v), abs=1e-12)
    assert result["costs"]["forward"] == [1.0] * (pp * v) and result["costs"]["send"] == 0.0


@pytest.mark.parametrize(
    "name, pp, m, v",
    [("gpipe", 3, 4, 1), ("1f1b", 2, 4, 1), ("zb-h2", 3, 6, 1), ("zb-v", 2, 4, 2),
     ("dualpipev", 2, 4, 2), ("interleaved-1f1b", 2, 4, 2)],
)  # fmt: skip
def test_simulated_trace_with_gaps_tails_and_whole_backwards_measures_what_it_predicts(
    name, pp, m, v
):
    # what simulate() models beyond F/B/W (a rank's gap between actions, the longer last
    # weight-gradient action, whole backwards beside split ones) is measured back from the rows
    # by the same rules, so a trace laid out by the simulator is predicted exactly
    num_stages = pp * v
    costs = Costs(
        forward=[1.0 + 0.25 * s for s in range(num_stages)],
        backward=[1.5 - 0.125 * s for s in range(num_stages)],
        weight=[0.75 + 0.125 * s for s in range(num_stages)],
        whole=[2.75 + 0.25 * s for s in range(num_stages)],
        tail=0.5,
        gap=0.0625,
    )
    actions, placement = build_schedule(name, pp, m, v, True), placement_of(name, pp, v)
    sim = simulate(actions, placement, costs)
    code = {"F": "forward", "B": "backward", "W": "weight"}
    spec = [
        (placement.rank_of(a.stage), a.stage, 0, code[a.kind], step, a.microbatch,
         origin + t, origin + sim.end[a])
        for step, origin in ((0, 0.0), (1, 100.0), (2, 200.0))
        for a, t in sim.start.items()
    ]  # fmt: skip
    events = rows(spec)
    ran = make_schedule(name, pp, m, v, early_grad_send=True)
    result = bubble_summary(events[np.argsort(events["start"])], ran, skip_steps=1)
    assert sim.bubble_fraction > 0.0
    assert result["measured"] == pytest.approx(sim.bubble_fraction, abs=1e-9)
    assert result["predicted"] == pytest.approx(sim.bubble_fraction, abs=1e-9)
    assert result["costs"]["gap"] == pytest.approx(0.0625, abs=1e-9)
    assert result["costs"]["forward"] == pytest.approx(costs.forward, abs=1e-9)
    # without the gap and the tail the same costs predict less idle than the trace holds
    plain = simulate(actions, placement, dataclasses.replace(costs, gap=0.0, tail=0.0))
    assert plain.bubble_fraction < result["measured"] - 1e-3


def test_predicted_bubble_averages_each_steps_simulation_as_the_measured_one_does():
    # step 1 has equal costs, step 2 a slow last stage: each step is simulated with its own
    # costs and the fractions averaged, as the measured fractions are
    actions, placement = build_schedule("1f1b", 2, 4), Placement.loop(2)
    code = {"F": "forward", "B": "backward", "W": "weight"}
    sims, spec = [], []
    for step, forward in ((1, [1.0, 1.0]), (2, [1.0, 3.0])):
        sim = simulate(actions, placement, Costs(forward, 2.0, 0.0))
        sims.append(sim.bubble_fraction)
        spec += [
            (placement.rank_of(a.stage), a.stage, 0, code[a.kind], step, a.microbatch,
             100.0 * step + t, 100.0 * step + sim.end[a])
            for a, t in sim.start.items()
        ]  # fmt: skip
    result = bubble_summary(rows(spec), make_schedule("1f1b", 2, 4), skip_steps=1)
    assert result["steps"] == [1, 2]
    assert result["predicted"] == pytest.approx(sum(sims) / 2, abs=1e-12)
    assert result["measured"] == pytest.approx(sum(sims) / 2, abs=1e-12)
    # one simulation of the costs averaged over the steps is not what the steps idled
    means = simulate(actions, placement, Costs([1.0, 2.0], 2.0, 0.0)).bubble_fraction
    assert abs(means - result["measured"]) > 0.01


def test_message_latency_median_and_mean():
    spec = []
    for mb, hop in enumerate((0.125, 0.125, 0.5)):  # three hops, the receiver already waiting
        t = 10.0 * mb
        spec += [
            (0, 0, 0, "forward", 1, mb, t, t + 1.0),
            (0, 0, 0, "send", 1, mb, t + 1.0, t + 1.0),
            (1, 1, 0, "recv", 1, mb, t + 0.5, t + 1.0 + hop),
            (1, 1, 0, "forward", 1, mb, t + 1.0 + hop, t + 2.0 + hop),
        ]
    events = rows(spec)
    assert message_latency(events) == 0.125  # a typical hop
    assert message_latency(events, mean=True) == 0.25  # what the three cost, each


def test_a_hop_and_a_tail_below_zero_read_as_zero():
    # the ranks' clocks offset by a little more than the hop: the consumer seems to start
    # before its producer ended; and a stage's last W quicker than its others
    spec = [
        (0, 0, 0, "forward", 1, 0, 0.0, 1.0),
        (0, 0, 0, "send", 1, 0, 1.0, 1.0),
        (1, 1, 0, "recv", 1, 0, 0.5, 0.9),
        (1, 1, 0, "forward", 1, 0, 0.9, 1.9),
        (0, 0, 0, "weight", 1, 0, 2.0, 3.0),
        (0, 0, 0, "weight", 1, 1, 3.0, 3.5),  # the last W: 0.5 below the other
    ]
    events = rows(spec)
    assert message_latency(events) == 0.0 and message_latency(events, mean=True) == 0.0
    assert stage_costs(events, 2, 0.0)["tail"][0] == 0.0


def test_idle_gap_leaves_out_waits_for_a_message():
    def gap(f1_end: float, send: float = 0.0) -> float:
        spec = [
            (0, 0, 0, "forward", 1, 0, 0.0, 1.0),
            (0, 0, 0, "forward", 1, 1, 1.125, f1_end),  # 0.125 after 0F0: waited for nothing
            (1, 1, 0, "forward", 1, 0, 1.5, 2.5),
            (1, 1, 0, "forward", 1, 1, 4.0, 5.0),  # 1.5 after 1F0: waited for 0F1, or not
        ]
        return stage_costs(rows(spec), 2, send)["gap"]

    assert gap(2.25) == 0.8125  # 0F1 was there when 1F0 ended: both gaps count
    assert gap(2.75) == 0.125  # 0F1 ended after 1F0: 1F1 waited for it
    assert gap(2.25, send=0.5) == 0.125  # ... or was still on its way


def test_analyze_a_synthetic_trace_without_a_job():
    spec = [(0, 0, 0, "forward", 0, 0, 0.0, 1.0), (0, 0, 0, "backward", 0, 0, 1.0, 3.0),
            (0, -1, 0, "step", 0, -1, 0.0, 4.0)]  # fmt: skip
    trace = Trace(rows(spec), {}, "", {"pp": 1, "dp": 1, "schedule": "gpipe", "microbatches": 1})
    result = analyze(trace)
    assert result["ranks"][0]["idle"] == pytest.approx(1.0)
    assert result["bubble"]["measured"] == 0.0
    assert result["throughput"]["samples_per_s"] is None  # no job, no batch size
    assert "bubble" in format_analysis(result)


def test_a_sharded_runs_two_ring_rows_are_two_phases_with_their_own_busbw():
    """train.shard_optimizer: per bucket a rank records the gradient reduce-scatter, then (after
    the update) the weight all-gather, both as allreduce rows. Each is its own phase: a ring
    reduce-scatter or all-gather moves (n-1)/n of the vector (busbw = algbw (n-1)/n), an
    all-reduce 2(n-1)/n. Times per ring call: the shortest rank's; per step: over buckets."""
    from mpihybrid.analysis.bandwidth import allreduce_bandwidth

    n, params = 4, [1000]
    spec, wire = [], []
    for step in (1, 2):
        for bucket in (0, 1):
            t = 10.0 * step + 4 * bucket
            for rank in range(n):
                late = 0.5 * rank  # the shortest duration is the ring's own time: rank 0's
                spec.append((rank, 0, rank, "allreduce", step, bucket, t, t + 1 + late))  # RS
                spec.append((rank, 0, rank, "allreduce", step, bucket, t + 2, t + 4 + late))
                wire += [300, 100]  # the gather sends int8: fewer bytes
    events = rows(spec)
    events["bytes"] = wire
    out = allreduce_bandwidth(events[::-1], params, n, sharded=True)  # row order must not matter
    assert [(r["stage"], r["phase"]) for r in out] == [(0, "reduce-scatter"), (0, "all-gather")]
    rs, ag = out
    assert rs["seconds"] == pytest.approx(2 * 1.0) and ag["seconds"] == pytest.approx(2 * 2.0)
    assert rs["algbw"] == pytest.approx(4000 / 2.0) and ag["algbw"] == pytest.approx(4000 / 4.0)
    assert rs["busbw"] == pytest.approx(rs["algbw"] * 3 / 4)
    assert ag["busbw"] == pytest.approx(ag["algbw"] * 3 / 4)
    assert (rs["wire_bytes"], ag["wire_bytes"]) == (600, 200)  # one rank, one step: 2 buckets
    (whole,) = allreduce_bandwidth(events, params, n)  # unsharded: one ring, both rows its own
    assert whole["phase"] == "all-reduce" and whole["busbw"] == pytest.approx(
        whole["algbw"] * 2 * 3 / 4
    )
