"""The critical path, idle by cause and the replay on hand-built traces whose answer is known."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from mpihybrid.analysis.critical import critical_paths, shares
from mpihybrid.analysis.idle import attribute_idle
from mpihybrid.analysis.lanes import Lanes
from mpihybrid.analysis.replay import Change, Measured, gain_table, replay
from mpihybrid.pipeline.schedules import build_schedule, placement_of
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.trace.read import Trace
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND


def rows(spec: list[tuple]) -> np.ndarray:
    """(rank, stage, kind, step, mb, start, end, peer[, cpu]) tuples -> event rows (replica =
    0; the CPU time NaN, as a GPU's, unless given)."""
    out = np.zeros(len(spec), dtype=EVENT_DTYPE)
    for i, (rank, stage, kind, step, mb, start, end, peer, *cpu) in enumerate(spec):
        out[i] = (rank, stage, 0, KIND[kind], step, mb, start, end, 0, peer, *(cpu or [np.nan]))
    return out


# one step, pp = 2, M = 1: rank 0's F feeds rank 1, whose B feeds rank 0 back
TWO_RANKS = [
    (0, -1, "step", 0, -1, 0.0, 10.0, -1),
    (0, 0, "forward", 0, 0, 0.0, 2.0, -1),
    (0, 0, "send", 0, 0, 2.0, 2.1, 1),
    (0, 0, "recv", 0, 0, 2.1, 7.5, 1),
    (0, 0, "backward", 0, 0, 7.5, 9.5, -1),
    (1, -1, "step", 0, -1, 0.0, 8.0, -1),
    (1, 1, "recv", 0, 0, 0.0, 2.3, 0),
    (1, 1, "forward", 0, 0, 2.3, 4.3, -1),
    (1, 1, "backward", 0, 0, 4.3, 7.2, -1),
    (1, 1, "send", 0, 0, 7.2, 7.3, 0),
]


def test_critical_path_of_a_known_step():
    (path,) = critical_paths(Lanes.of(rows(TWO_RANKS)))
    got = [(k.kind, k.rank, round(k.start, 9), round(k.end, 9)) for k in path.links]
    assert got == [
        ("F", 0, 0.0, 2.0),
        ("send", 0, 2.0, 2.1),
        ("hop", 1, 2.1, 2.3),
        ("F", 1, 2.3, 4.3),
        ("B", 1, 4.3, 7.2),
        ("send", 1, 7.2, 7.3),
        ("hop", 0, 7.3, 7.5),
        ("B", 0, 7.5, 9.5),
        ("gap", 0, 9.5, 10.0),
    ]
    assert path.seconds == pytest.approx(10.0)
    assert shares([path]) == pytest.approx(
        {"B s1": 0.29, "F s0": 0.2, "F s1": 0.2, "B s0": 0.2, "runtime": 0.07, "hop": 0.04}
    )


def test_idle_of_a_known_step_goes_to_its_causes():
    result = attribute_idle(Lanes.of(rows(TWO_RANKS)), [0])
    r0, r1 = result["ranks"]
    assert r0["idle"] == pytest.approx(6.0) and r1["idle"] == pytest.approx(3.1)
    assert r0["causes"] == pytest.approx(
        {"late sender": 5.2, "hop": 0.2, "gradient all-reduce": 0.0, "step boundary": 0.5,
         "own runtime": 0.1}
    )  # fmt: skip
    assert r0["senders"] == pytest.approx({"rank 1 B0 of stage 1": 5.2})
    assert r1["causes"] == pytest.approx(
        {"late sender": 2.1, "hop": 0.2, "gradient all-reduce": 0.0, "step boundary": 0.7,
         "own runtime": 0.1}
    )  # fmt: skip
    assert r1["senders"] == pytest.approx({"rank 0 F0 of stage 0": 2.1})


def simulated_trace(name: str, pp: int, m: int, costs: Costs, steps: int = 3) -> Trace:
    """A trace laid out by simulate(): every cross-rank input a zero-length send at its
    producer's end and a receive from the consumer's previous action to its start."""
    actions, placement = build_schedule(name, pp, m, 1, True), placement_of(name, pp)
    sim = simulate(actions, placement, costs)
    code = {"F": "forward", "B": "backward", "W": "weight"}
    end_of = {(b.kind, b.stage, b.microbatch): t for b, t in sim.end.items()}
    spec = []
    for step in range(steps):
        origin = 100.0 * step
        last_end = {}
        ordered = sorted(sim.start, key=lambda a: sim.start[a])
        for r in range(pp):
            spec.append((r, -1, "step", step, -1, origin, origin + sim.makespan, -1))
        for a in ordered:
            rank, t0 = placement.rank_of(a.stage), origin + sim.start[a]
            src = a.stage - 1 if a.kind == "F" else a.stage + 1
            if a.kind in "FB" and 0 <= src < placement.num_stages:
                peer = placement.rank_of(src)
                if peer != rank:
                    t = origin + end_of[(a.kind, src, a.microbatch)]
                    spec.append((peer, src, "send", step, a.microbatch, t, t, rank))
                    spec.append((rank, a.stage, "recv", step, a.microbatch,
                                 last_end.get(rank, origin), t0, peer))  # fmt: skip
            spec.append((rank, a.stage, code[a.kind], step, a.microbatch, t0,
                         origin + sim.end[a], -1))  # fmt: skip
            last_end[rank] = origin + sim.end[a]
    events = rows(spec)
    events = events[np.argsort(events["start"], kind="stable")]
    attrs = {"pp": pp, "dp": 1, "world_size": pp, "microbatches": m, "schedule": name,
             "early_grad_send": True, "virtual_stages": 1}  # fmt: skip
    return Trace(events, {}, "", attrs), sim


@pytest.mark.parametrize("name, pp, m", [("1f1b", 2, 4), ("gpipe", 3, 3), ("zb-h1", 2, 4)])
def test_a_simulated_trace_has_a_gapless_path_and_exact_idle(name, pp, m):
    costs = Costs(forward=[1.0, 1.5, 1.25][:pp], backward=1.0, weight=0.5)
    trace, sim = simulated_trace(name, pp, m, costs)
    lanes = Lanes.of(trace.events)
    for path in critical_paths(lanes, [1, 2]):
        assert path.seconds == pytest.approx(sim.makespan)
        assert all(k.kind != "gap" and k.seconds >= -1e-12 for k in path.links)
        assert sum(k.seconds for k in path.links) == pytest.approx(sim.makespan)
    idle = attribute_idle(lanes, [1, 2])
    for r, row in enumerate(idle["ranks"]):
        assert row["idle"] == pytest.approx(2 * sim.idle[r])
        assert row["attributed"] == pytest.approx(row["idle"])


def test_replay_of_a_simulated_trace_gives_its_makespan_and_a_change_its_simulation():
    costs = Costs(forward=[1.0, 2.0], backward=[1.5, 1.0], weight=[0.5, 0.75], send=0.0)
    trace, sim = simulated_trace("1f1b", 2, 4, costs)
    base = Measured.of(trace)
    assert replay(base, Change())["phase"] == pytest.approx(sim.makespan)
    zb = simulate(build_schedule("zb-h1", 2, 4, 1, True), placement_of("zb-h1", 2), costs)
    assert replay(base, Change(schedule="zb-h1"))["phase"] == pytest.approx(zb.makespan)
    fast = Costs(forward=[1.0, 1.0], backward=costs.backward, weight=costs.weight)
    want = simulate(build_schedule("1f1b", 2, 4, 1, True), placement_of("1f1b", 2), fast)
    asked = replay(base, Change(scales={("stage", 1, "F"): 0.5}))
    assert asked["phase"] == pytest.approx(want.makespan)
    for row in gain_table(base):
        assert row["zero"] <= row["half"] + 1e-12 <= row["now"] + 2e-12


def test_compare_puts_a_known_difference_on_its_cost():
    from mpihybrid.analysis.diff import diff

    costs = Costs(forward=[1.0, 2.0], backward=[1.5, 1.0], weight=[0.5, 0.75], send=0.0)
    slower = Costs(forward=[1.0, 3.0], backward=[1.5, 1.0], weight=[0.5, 0.75], send=0.0)
    (a, sim_a), (b, sim_b) = (simulated_trace("zb-h1", 2, 4, c) for c in (costs, slower))
    att = diff(a, b, "a", "b")["attribution"]
    assert att["measured"] == pytest.approx(sim_b.makespan - sim_a.makespan)
    assert att["residual"] == pytest.approx(0.0, abs=1e-9)
    top = att["items"][0]
    assert top["what"] == "stage 1 F" and top["ratio"] == pytest.approx(1.5)
    assert top["seconds"] == pytest.approx(att["measured"])


def test_the_live_line_says_when_ranks_share_a_core():
    # the quick start runs 4 ranks on 2 cores: a rank waiting for a core is not a slow rank
    from mpihybrid.train.live_stragglers import _caveat

    assert _caveat([("node0", 2), ("node0", 2), ("node1", 2)]) == ""
    crowded = _caveat([("node0", 2)] * 4)
    assert "4 ranks share 2 cores on node0" in crowded and "waiting for a core" in crowded


def _replicas(wall: float, cpu: float, steps: int = 6) -> np.ndarray:
    """dp = 2 at pp = 1: ranks 0 and 1 run one F a step; rank 1's takes `wall` x rank 0's
    time on the clock and `cpu` x its CPU time."""
    spec = []
    for step in range(steps):
        t = 10.0 * step
        spec.append((0, 0, "forward", step, 0, t, t + 1.0, -1, 1.0))
        spec.append((1, 0, "forward", step, 0, t, t + wall, -1, cpu))
    out = rows(spec)
    out["replica"][out["rank"] == 1] = 1
    return out


@pytest.mark.parametrize(
    "wall, cpu, verdict",
    [(1.3, 1.3, "chronic"), (1.3, 1.02, "waited"), (1.02, 1.02, "healthy"),
     (1.3, np.nan, "chronic")],
)  # fmt: skip
def test_a_rank_slow_on_the_clock_only_waited_for_a_core(wall, cpu, verdict):
    """Slow in wall time and in CPU time: a straggler; in wall time alone it waited for a core
    (another process on it), which is the host's doing: reported, never named. Without CPU
    times (NaN: a GPU run, a version 2 trace) the wall clock decides, as before."""
    from mpihybrid.analysis.stragglers import straggler_lines, stragglers

    found = stragglers(_replicas(wall, cpu), list(range(6)), dp=2)
    (score,) = [s for s in found["scores"] if s["rank"] == 1]
    assert score["verdict"] == verdict
    assert [s["rank"] for s in found["named"]] == ([1] if verdict == "chronic" else [])
    text = "\n".join(straggler_lines(found))
    assert ("waited for a core" in text) == (verdict == "waited"), text


@pytest.mark.parametrize(
    "wall, probe, verdict",
    [(1.3, [1.0, 1.3], "device"), (1.3, [1.0, 1.0], "chronic"), (1.3, [1.3, 1.0], "chronic"),
     (1.6, [1.0, 1.3], "chronic"), (1.3, None, "chronic"), (1.18, [1.0, 1.06], "healthy"),
     (3.5, [1.0, 3.0], "device"), (4.5, [1.0, 3.0], "chronic")],
)  # fmt: skip
def test_a_rank_slow_by_its_cores_speed_alone_is_a_slower_device(wall, probe, verdict):
    """Slow in wall and CPU time by as much as its core is slower than its replica's (the trace's
    core probe): a slower device, reported with what it costs, never named; slow beyond its
    core's speed, or on the faster core, or with no probe: a straggler in its work; a little
    slow on a core a little slower, neither beyond the other: healthy. On a 3x slower core a
    1.17x beyond it is within what the probe tells (slowdown.PROBE_FIT), 1.5x is not."""
    from mpihybrid.analysis.stragglers import straggler_lines, stragglers

    found = stragglers(_replicas(wall, wall), list(range(6)), dp=2, probe=probe)
    (score,) = [s for s in found["scores"] if s["rank"] == 1]
    assert score["verdict"] == verdict
    assert [s["rank"] for s in found["named"]] == ([1] if verdict == "chronic" else [])
    assert [d["rank"] for d in found["devices"]] == ([1] if verdict == "device" else [])
    text = "\n".join(straggler_lines(found))
    assert ("a slower device, not its work" in text) == (verdict == "device"), text
    if verdict == "device":
        assert found["devices"][0]["core"] == pytest.approx(probe[1])
        assert found["devices"][0]["kinds"] == {"F": pytest.approx(wall)}


class _Runtime:
    stages = {0}

    def __init__(self):
        self.kind_seconds = {k: [0.0, 0, 0.0] for k in "FBW"}


class _Gather:
    """world.gather over two replicas in one process: rank 1's row is scaled (its core's
    probe seconds by `core`)."""

    def __init__(self, wall: float, cpu: float, core: float = 1.0):
        self.wall, self.cpu, self.core = wall, cpu, core

    def gather(self, row, root=0):
        pp_rank, mean, stages, now, host, speed = row
        other_now = now.copy()
        other_now[0] *= self.wall
        other_now[2] *= self.cpu
        other_mean = mean.copy()
        other_mean[0] *= self.wall
        other_mean[1] *= self.cpu
        other = (pp_rank, other_mean, stages, other_now, host, speed * self.core)
        return [row, other]


class _Probe:
    def median(self):
        return 1e-4


@pytest.mark.parametrize(
    "cpu, core, logged", [(1.3, 1.0, True), (1.0, 1.0, False), (1.3, 1.3, False)]
)
def test_the_live_line_names_a_rank_only_when_its_cpu_time_is_slow_beyond_its_core(
    cpu, core, logged, caplog
):
    """Slow on the clock only (it waited for a core), or in CPU time by its core's speed alone
    (a slower device): no line; slow in CPU time on a core as fast as its replica's: the line."""
    from mpihybrid.train.live_stragglers import LiveStragglers

    watch, runtime, world = LiveStragglers(), _Runtime(), _Gather(1.3, cpu, core)
    probe = _Probe()
    with caplog.at_level(logging.WARNING, logger="mpihybrid"):
        for line in range(8):
            runtime.kind_seconds["F"] = [0.01 * (line + 1), 4 * (line + 1), 0.01 * (line + 1)]
            watch.observe(world, runtime, 0, probe)
    said = [r.getMessage() for r in caplog.records if "straggler:" in r.getMessage()]
    assert bool(said) == logged, said
    if logged:
        assert said[0].startswith("straggler: rank 1 (stage 0) F 1.30x")


def test_a_change_of_m_scales_each_stage_on_the_line_through_its_row_probe():
    """The trace's two timings of a chunk's pass (train/row_probe.py): a fixed part and one in
    the rows, carried to the new rows; a line that falls with the rows, or below zero at no
    rows, is taken as linear; a probe of other chunks is not used."""
    from mpihybrid.predict.rows import probed_factors

    # chunk 0: F = 1 ms + 1 us a row (128 rows: 1.128 ms, 64: 1.064), B linear, W noise
    seconds = [1.128e-3, 1.064e-3, 2e-3, 1e-3, 1e-3, 1.2e-3]
    got = probed_factors(([128, 64], seconds), 4, 8, 1)
    assert got["F"] == [pytest.approx(1.064 / 1.128)]
    assert got["B"] == [pytest.approx(0.5)] and got["W"] == [pytest.approx(0.5)]
    assert probed_factors(([128, 64], seconds), 4, 2, 1)["F"] == [pytest.approx(1.256 / 1.128)]
    # through zero below no rows: 2 ms at 128, 0.5 ms at 64 would cost -1 ms at none
    assert probed_factors(([128, 64], [2e-3, 0.5e-3] * 3), 4, 8, 1)["F"] == [0.5]
    assert probed_factors(([128, 64], seconds), 4, 8, 2) is None


def test_a_change_of_m_scales_the_costs_by_the_cost_model_not_linearly():
    """Half the rows cost more than half: a layer call's fixed cost and its weights' traffic
    stay (predict's cost model); where the trace's job is unreadable, linear in the rows."""
    from mpihybrid.predict.rows import row_factors

    job = (Path(__file__).resolve().parent.parent / "mpihybrid/jobs/gpt_bench.toml").read_text()
    half = row_factors(job, 4, 8, 2)
    for kind in "FBW":
        assert all(0.5 < x < 0.75 for x in half[kind]), half
    assert row_factors(job, 4, 4, 2) == {k: [1.0, 1.0] for k in "FBW"}
    assert row_factors("not toml [", 4, 8, 2) is None
    assert row_factors(job, 4, 8, 3) is None  # not the trace's stages


def test_a_slowdown_names_its_kinds_or_a_slower_device():
    """train.slowdown: some of F, B, W, or D alone (a slower device: every kind and the core
    probe); anything else is one error naming the choices."""
    from mpihybrid.pipeline.slowdown import Slowdown

    assert Slowdown.parse("1:D:1.3").device and not Slowdown.parse("1:FB:1.3").device
    for text in ("1:DF:1.3", "1:X:2", "1::2"):
        with pytest.raises(ValueError, match="D \\(a slower device\\)"):
            Slowdown.parse(text)
