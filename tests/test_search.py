"""Schedule search (pipeline/search*.py): the exact search proves known optima and matches brute
force, the greedy's unit-time case is the list scheduler zb-h2 and v-half are built by, searched
schedules are valid and dry-run, bad costs and limits are one line."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import re

import pytest

from mpihybrid.config import build_job
from mpihybrid.pipeline import search_exact
from mpihybrid.pipeline.csv_schedule import parse_csv
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.schedules import ScheduleError, dry_run, lower, validate
from mpihybrid.pipeline.search import TIE_MARGIN, csv_of, default_limit, search
from mpihybrid.pipeline.search_costs import CostsError, SearchCosts, check_values, unit_costs
from mpihybrid.pipeline.search_greedy import best_greedy, list_schedule
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.pipeline.v_schedules import v_half, zb_h2

# the tests that prove optima need the exact search (the search extra); without it the search says
# "heuristic", rightly
needs_cp_sat = pytest.mark.skipif(
    importlib.util.find_spec("ortools") is None,
    reason="OR-Tools' CP-SAT is not installed (the search extra): the search is the greedy's",
)


def _best_builtin(result) -> float:
    return min(r["makespan"] for r in result.table if "makespan" in r and not r["note"])


@needs_cp_sat
def test_unit_pp2_m4_is_proved_optimal_and_equals_the_best_builtin():
    result = search(unit_costs(2), 2, 4, time_limit=30, deterministic=True)
    assert result.status == "optimal"
    assert math.isclose(result.best.sim.makespan, result.bound)
    assert math.isclose(result.best.sim.makespan, _best_builtin(result))  # zb-v's 25 = 6m+p-1
    assert result.best.sim.makespan == 25


@needs_cp_sat
@pytest.mark.parametrize("pp, m", [(2, 4), (3, 6), (4, 8)])
def test_exact_loop_reaches_zb_h1_with_unit_costs(pp, m):
    # 3m+p-1 is zb-h1's makespan at rank memory p, and no order does better (the first F
    # reaches rank p-1 after p-1 steps, which then has 3m steps of its own work)
    placement = Placement.loop(pp)
    res = search_exact.solve(placement, m, Costs(1, 1, 1), limit=[pp] * pp, time_limit=30,
                             deterministic=True)  # fmt: skip
    assert res.status == "optimal" and res.makespan == 3 * m + pp - 1
    validate(res.lists, placement, m)


def _brute_force(placement: Placement, m: int, costs: Costs) -> float:
    """The least makespan over every per-rank order of whole F/B (no memory limit)."""
    per_rank = {
        r: [(k, s, mb) for s in placement.stages_of(r) for mb in range(m) for k in "FB"]
        for r in range(placement.pp)
    }
    from mpihybrid.pipeline.actions import Action

    best = math.inf
    orders = [itertools.permutations(acts) for acts in per_rank.values()]
    for combo in itertools.product(*orders):
        lists = {r: [Action(s, k, mb) for k, s, mb in order] for r, order in enumerate(combo)}
        try:
            validate(lists, placement, m)
        except ScheduleError:
            continue
        best = min(best, simulate(lists, placement, costs).makespan)
    return best


@needs_cp_sat
def test_exact_matches_brute_force_on_unequal_costs():
    placement = Placement.loop(2)
    costs = Costs(forward=[1.0, 3.0], backward=[2.0, 1.0], weight=[0.0, 0.0], send=0.5)
    res = search_exact.solve(placement, 2, costs, limit=[4, 4], split=False, fifo=False,
                             time_limit=30, deterministic=True)  # fmt: skip
    assert res.status == "optimal"
    found = simulate(res.lists, placement, costs).makespan
    assert math.isclose(found, _brute_force(placement, 2, costs), rel_tol=1e-3)


@pytest.mark.parametrize("pp, m", [(2, 4), (3, 6), (4, 8)])
def test_greedy_with_unit_costs_is_the_unit_time_list_scheduler(pp, m):
    loop = list_schedule(Placement.loop(pp), m, Costs(1, 1, 1),
                         limit=[max(pp, 2 * (pp - r) - 1) for r in range(pp)])  # fmt: skip
    assert loop == zb_h2(pp, m)
    v = list_schedule(Placement.v(pp), m, Costs(1, 1, 1), limit=[2 * ((pp + 2) // 2)] * pp,
                      reserve=1)  # fmt: skip
    assert v == v_half(pp, m)


def test_imbalanced_costs_searched_split_and_order_beat_every_builtin():
    # a head of three layers' cost: the split decides as much as the order
    n = 8
    work = [1.0] * (n - 1) + [3.0]
    costs = SearchCosts(tuple(work), tuple(work), tuple(work), send=0.05, source="test")
    result = search(costs, 2, 4, time_limit=20, deterministic=True)
    assert result.best.sim.makespan <= _best_builtin(result) + 1e-9
    # the default limit: what the fastest built-in holds, so the searched one holds no more
    fastest = min((r for r in result.table if "makespan" in r),
                  key=lambda r: (r["makespan"], r["peak"]))  # fmt: skip
    assert result.max_inflight == max(2, fastest["peak"])
    assert result.best.sim.makespan <= fastest["makespan"] + 1e-9
    assert max(result.best.sim.peak_per_rank) <= fastest["peak"]
    assert result.step_bound <= result.best.sim.makespan
    lists, placement = result.best.lists, result.best.placement
    validate(lists, placement, 4)
    # buffered, as every built-in is checked (1F1B itself needs its receives posted first: the
    # runtime posts them; tests/test_search_train.py runs searched lists with comm.sync_sends)
    dry_run(lower(lists, placement), placement, synchronous=False)
    # the CSV reads back as the same lists
    back, back_placement, m = parse_csv(csv_of(result), "search.csv")
    assert back == lists and back_placement == placement and m == 4


def test_same_costs_same_schedule():
    costs = SearchCosts((1.0, 2.0, 1.5, 1.0), (1.0, 2.0, 1.0, 2.0), (0.5, 1.0, 1.0, 0.5),
                        send=0.1, source="test")  # fmt: skip
    runs = [
        search(costs, 2, 4, placements=("loop",), time_limit=1, deterministic=True).best.lists
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "forward, match",
    [((float("nan"), 1.0), "block 0 has F = nan"), ((0.0, 1.0), "block 0 has F = 0.0"),
     ((1.0, -2.0), "block 1 has F = -2.0")],
)  # fmt: skip
def test_bad_costs_are_one_line(forward, match):
    with pytest.raises(CostsError, match=match):
        check_values(SearchCosts(forward, (1.0, 1.0), (1.0, 1.0), source="test"))


def test_a_limit_below_one_names_the_smallest():
    with pytest.raises(ScheduleError, match="smallest limit any schedule meets is 1"):
        search(unit_costs(2), 2, 4, max_inflight=0.5)


def test_solver_missing_gives_the_heuristic(monkeypatch):
    def missing(*args, **kwargs):
        raise search_exact.SolverMissing("the exact search needs OR-Tools: pip install x")

    monkeypatch.setattr(search_exact, "solve", missing)
    result = search(unit_costs(2), 2, 4)
    assert result.status == "heuristic" and any("OR-Tools" in n for n in result.notes)
    validate(result.best.lists, result.best.placement, 4)


@needs_cp_sat
def test_timeout_gives_the_best_found_and_its_gap():
    costs = SearchCosts(tuple(1.0 + 0.37 * (i % 3) for i in range(8)), (1.3,) * 8, (0.9,) * 8,
                        send=0.07, source="test")  # fmt: skip
    placement = Placement.v(4)
    res = search_exact.solve(placement, 8, costs.split([range(i, i + 1) for i in range(8)]),
                             limit=[8] * 4, time_limit=0.05, fifo=False)  # fmt: skip
    assert res.seconds < 5
    assert res.status in ("feasible", "optimal", "unknown")
    if res.lists is not None:
        assert res.gap >= 0 and res.bound <= res.makespan + 1e-9


def test_default_limit_is_the_fastest_builtins_peak_and_at_least_p():
    rows = [{"schedule": "a", "makespan": 10.0, "peak": 3.0},
            {"schedule": "b", "makespan": 10.0, "peak": 2.5},
            {"schedule": "c", "makespan": 11.0, "peak": 1.0},
            {"schedule": "d", "note": "not legal"}]  # fmt: skip
    assert default_limit(rows, 2) == 2.5  # a tie: the lower peak
    assert default_limit(rows, 4) == 4.0  # never below 1F1B's p
    assert default_limit([{"schedule": "d", "note": "x"}], 3) == 3.0


def test_a_search_ticks_the_watchdog(monkeypatch):
    # a long search at a run's start is work, not a stall: it ticks mpihybrid.progress, the
    # exact solve too while it runs (in a thread of its own)
    from mpihybrid import progress

    class Flight:
        ticks: list[str] = []

        def tick(self, what: str = "") -> None:
            self.ticks.append(what)

    flight = Flight()
    monkeypatch.setattr(progress, "_watched", flight)
    search(unit_costs(2), 2, 4, time_limit=1)
    assert "searching a schedule" in flight.ticks
    assert "searching a schedule (greedy)" in flight.ticks
    if importlib.util.find_spec("ortools"):
        assert "searching a schedule (exact)" in flight.ticks


def test_sweep_takes_auto_beside_the_builtins():
    from mpihybrid.cli.sweep_plan import parse_schedules
    from mpihybrid.pipeline.schedules import SCHEDULES

    assert parse_schedules("zb-h1,auto") == ["zb-h1", "auto"]
    assert parse_schedules("all,auto") == [*SCHEDULES, "auto"]


def test_predict_runs_auto_as_searched_on_the_cost_model():
    # predict's auto: the search on the cost model's per-block times; the job it then predicts
    # runs the searched lists and split, so its pipeline is the search's simulated step, and no
    # built-in within the limit is predicted faster on the same costs
    from mpihybrid.cli.predict import _load_job
    from mpihybrid.predict.cluster import find_cluster, load_cluster
    from mpihybrid.predict.model import predict
    from mpihybrid.predict.searched import block_costs, predicted_auto

    job = _load_job("jobs/gpt_bench.toml", ["train.schedule=auto"])
    cluster = load_cluster(find_cluster("local"))
    searched, line, result = predicted_auto(job, cluster, time_limit=1)
    assert searched.train.schedule.startswith("csv:auto@") and "blocks per stage" in line
    assert result.costs == block_costs(job, cluster)
    assert math.isclose(predict(searched, cluster)["pipeline_s"], result.best.sim.makespan)
    assert result.best.sim.makespan <= _best_builtin(result) + 1e-12


def test_fill_bounds_hold_and_are_reached_on_a_head_heavy_model():
    # five light blocks and a head as heavy as all of them: at M=4 the head's rank waits for
    # the first micro-batch's forward through the five, and no placement avoids it
    from mpihybrid.pipeline.search_bounds import any_placement_bound, busiest_work, fill_bound

    f = (0.1, 1.0, 1.0, 1.0, 1.0, 4.0)
    costs = SearchCosts(f, f, f, source="test")
    result = search(costs, 2, 4, max_inflight=4, time_limit=20, deterministic=True)
    best = result.best
    work = busiest_work(costs, best.placement, best.ranges, 4)
    fill = fill_bound(costs, best.placement, best.ranges, 4)
    anywhere = any_placement_bound(costs, 2, 4)
    assert work < anywhere <= fill <= best.sim.makespan + 1e-9
    assert anywhere == pytest.approx(4.1 + 4 * 12.0)  # the five forwards, then the head's work
    assert result.searched.sim.makespan == pytest.approx(anywhere)  # reached: it is optimal
    assert best.sim.makespan <= anywhere / (1 - TIE_MARGIN)  # or a built-in within the margin
    # no order of any split of either placement beats its own fill bound
    for placement in (Placement.loop(2), Placement.v(2)):
        from mpihybrid.pipeline.search import splits

        for ranges in splits(costs, placement, 20):
            lists, sim = best_greedy(placement, 4, costs.split(ranges), max_inflight=4)
            assert sim.makespan >= fill_bound(costs, placement, ranges, 4) - 1e-9
            assert fill_bound(costs, placement, ranges, 4) >= anywhere - 1e-9


def test_a_tie_keeps_the_fastest_builtins_placement_split_and_order():
    # unit costs, pp=2, M=4: nothing beats the fastest built-in by TIE_MARGIN, so the answer is
    # that built-in itself, as `schedule show` builds it, at its balanced split
    from mpihybrid.pipeline.schedules import build_schedule, placement_of

    result = search(unit_costs(2), 2, 4, time_limit=5, deterministic=True)
    fits = [r for r in result.table if "makespan" in r and not r["note"]]
    fastest = min(fits, key=lambda r: (r["makespan"], r["peak"]))
    best = result.best
    assert best.how == fastest["schedule"]
    assert best.lists == build_schedule(best.how, 2, 4, fastest["v"], early_grad_send=True)
    assert best.placement == placement_of(best.how, 2, fastest["v"])
    assert best.sim.makespan == pytest.approx(fastest["makespan"])


def test_job_costs_carry_each_blocks_update_and_the_link():
    from mpihybrid.cli.link_probe import probe_link
    from mpihybrid.cli.predict import _load_job
    from mpihybrid.pipeline.search_costs import job_costs

    job = _load_job("jobs/gpt_bench.toml", ["train.schedule=auto", "model.depth=2"])
    assert probe_link(None, job) == (0.0, 0.0)  # one process: no hop to measure
    costs = job_costs(job, repeats=1, link=(2e-4, 3e-5))
    assert (costs.send, costs.gap) == (2e-4, 3e-5)
    # the embedding, two layers and the head each have parameters, so an update that takes time
    assert len(costs.tail) == costs.units == 4 and min(costs.tail) > 0
    stages = costs.split([range(0, 2), range(2, 4)])
    assert stages.tail == pytest.approx([costs.tail[0] + costs.tail[1], sum(costs.tail[2:])])
    assert (stages.send, stages.gap) == (2e-4, 3e-5)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_schedule_placement_forces_the_placement(placement):
    result = search(unit_costs(2), 2, 4, placements=(placement,), time_limit=2, deterministic=True)
    assert result.best.placement.style == placement


def test_a_forced_loop_keeps_pp_stages_where_interleaved_is_the_fastest_builtin():
    # unequal blocks on which interleaved-1f1b (a loop of 2 pp stages) is the fastest built-in
    # and the searched loop is within the tie margin: the pp-stage loop asked for still runs
    f = (1.02, 1.52, 1.64, 1.93, 1.89, 1.12, 1.87, 1.88, 0.65, 1.44)
    b = (1.11, 1.39, 1.80, 2.23, 2.25, 1.12, 2.22, 1.89, 0.76, 1.26)
    w = (0.71, 1.79, 1.39, 2.23, 1.47, 1.23, 1.57, 1.92, 0.51, 1.39)
    costs = SearchCosts(f, b, w, send=0.1, gap=0.05)
    free = search(costs, 2, 4, time_limit=2, deterministic=True)
    assert free.best.how == "interleaved-1f1b"  # asked nothing: the fastest built-in is kept
    loop = search(costs, 2, 4, placements=("loop",), time_limit=2, deterministic=True)
    assert loop.best.placement == Placement.loop(2)
    assert search(costs, 2, 4, placements=("v",), time_limit=2).best.placement == Placement.v(2)


def test_calibrated_costs_sum_to_what_the_run_measured_stage_by_stage():
    from mpihybrid.pipeline.search_costs import calibrated

    blocks = SearchCosts((1.0, 2.0, 3.0, 4.0), (2.0, 2.0, 2.0, 2.0), (1.0, 1.0, 1.0, 1.0),
                         send=1e-3, tail=(0.5, 0.0, 0.25, 0.25))  # fmt: skip
    ranges = [range(0, 2), range(2, 4)]
    run = SearchCosts((6.0, 14.0), (2.0, 8.0), (4.0, 2.0), send=2e-3, gap=1e-4,
                      tail=(1.0, 2.0), fixed=True, source="a run")  # fmt: skip
    out = calibrated(blocks, ranges, run)
    stages = out.split(ranges)
    assert stages.forward == pytest.approx([6.0, 14.0])
    assert stages.backward == pytest.approx([2.0, 8.0])
    assert stages.weight == pytest.approx([4.0, 2.0])
    assert stages.tail == pytest.approx([1.0, 2.0])
    assert out.forward == pytest.approx((2.0, 4.0, 6.0, 8.0))  # each keeps its share
    assert out.tail[:2] == pytest.approx((1.0, 0.0))
    assert (out.send, out.gap) == (2e-3, 1e-4) and "calibrated on a run" in out.source
    # another split of the same blocks carries each stage's factor with its blocks
    assert out.split([range(0, 1), range(1, 4)]).forward == pytest.approx([2.0, 18.0])
    # a run of whole backwards: B and W together, in their timed shares
    whole = dataclasses.replace(run, backward=(6.0, 9.0), weight=(0.0, 0.0), can_split=False)
    out = calibrated(blocks, ranges, whole)
    assert out.backward[:2] == pytest.approx((2.0, 2.0)) and out.weight[:2] == (1.0, 1.0)
    assert out.split(ranges).backward[1] + out.split(ranges).weight[1] == pytest.approx(9.0)
    with pytest.raises(CostsError, match="2 stages, the split has 3"):
        calibrated(blocks, [range(0, 1), range(1, 2), range(2, 4)], run)


def test_schedule_placement_is_checked():
    from mpihybrid.cli.predict import _load_job
    from mpihybrid.config import ConfigError

    with pytest.raises(ConfigError, match="train.schedule_placement = 'w'"):
        _load_job("jobs/gpt_bench.toml", ["train.schedule=auto", "train.schedule_placement=w"])
    with pytest.raises(ConfigError, match="a list of 4 counts"):
        _load_job("jobs/gpt_bench.toml", ["train.schedule=auto", "train.schedule_placement=v",
                                          "model.partition=[2, 2]"])  # fmt: skip
    with pytest.raises(ConfigError, match="train.schedule_calibrate = 2: 0"):
        _load_job("jobs/gpt_bench.toml", ["train.schedule=auto", "train.schedule_calibrate=2"])


def test_bench_names_what_auto_chose():
    """bench train's header says which placement, finder and split auto's search chose."""
    import json

    from mpihybrid.cli.bench_train import _schedule_name
    from mpihybrid.config import Searched
    from mpihybrid.pipeline.csv_schedule import dump_csv
    from mpihybrid.pipeline.plan import make_schedule
    from mpihybrid.pipeline.simulate import simulate, unit_costs

    job = build_job({"grid": {"pp": 2, "dp": 1}, "model": {"depth": 4}})
    assert _schedule_name(job) == job.train.schedule  # not searched: as it is
    zbv = make_schedule("zb-v", 2, 4, 2)
    text = dump_csv(
        zbv.lists(), simulate(zbv.lists(), zbv.placement, unit_costs(zbv.lists())).start
    )
    name = "csv:auto@0123456789ab"
    found = Searched(name, text, json.dumps({"placement": "v", "found_by": "zb-v"}))
    train = dataclasses.replace(job.train, schedule=name, virtual_stages=2)
    searched = dataclasses.replace(job, train=train, searched=found)
    split = job.model.partition
    assert _schedule_name(searched) == f"{name} (auto: v by zb-v, split {split})"
    assert searched.schedule.lists() == zbv.lists() and searched.schedule.csv == text


def test_schedule_time_is_checked_and_zero_searches_without_the_solver():
    """train.schedule_time: the exact search's deterministic limit; negative, NaN or inf is one
    line, 0 runs no exact solve (the greedy and the built-ins: no proven bound)."""
    from mpihybrid.cli.predict import _load_job
    from mpihybrid.config import ConfigError
    from mpihybrid.predict.cluster import find_cluster, load_cluster
    from mpihybrid.predict.searched import predicted_auto

    sets = ["train.schedule=auto"]
    for value, says in (("-1", "train.schedule_time = -1.0: 0 (no exact search)"),
                        ("nan", "train.schedule_time = nan"),
                        ("inf", "train.schedule_time = inf: must be a finite")):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(says)):
            _load_job("jobs/gpt_bench.toml", [*sets, f"train.schedule_time={value}"])
    job = _load_job("jobs/gpt_bench.toml", ["train.schedule=auto", "train.schedule_time=0"])
    _, _, result = predicted_auto(job, load_cluster(find_cluster("local")))
    assert result.status == "heuristic" and not result.solver_seconds
