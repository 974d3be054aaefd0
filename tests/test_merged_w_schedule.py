"""Merged W passes in the schedule IR (actions.merge_weights, train.merge_w): the lists, their
checks, CSV both ways, the simulator's cost and liveness, the search's choice, the config."""

from __future__ import annotations

import dataclasses

import pytest

from mpihybrid.config import ConfigError, load_job
from mpihybrid.pipeline.actions import Action, merge_weights, split_backwards
from mpihybrid.pipeline.csv_schedule import dump_csv, parse_csv
from mpihybrid.pipeline.plan import make_schedule, trace_schedule
from mpihybrid.pipeline.schedules import (
    ScheduleError,
    build_schedule,
    lower,
    placement_of,
    validate,
)
from mpihybrid.pipeline.search import search
from mpihybrid.pipeline.search_costs import CostsError, check_values, unit_costs
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.pipeline.simulate import unit_costs as sim_unit_costs
from tests.helpers import ROOT


def _ws(lists):
    return {r: [a for a in acts if a.kind == "W"] for r, acts in lists.items()}


@pytest.mark.parametrize("name, v", [("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("group", [2, 3, 8])
def test_merged_lists_cover_every_w_once_and_validate(name, v, group):
    plain = build_schedule(name, 2, 8, v, early_grad_send=True)
    merged = build_schedule(name, 2, 8, v, early_grad_send=True, merge_w=group)
    placement = placement_of(name, 2, v)
    validate(merged, placement, 8)  # every W after its B, once; dependencies met
    assert split_backwards(merged) == split_backwards(plain)
    for r in plain:
        # the other actions keep their order; a group runs where its last member ran
        assert [a for a in merged[r] if a.kind != "W"] == [a for a in plain[r] if a.kind != "W"]
        for w in _ws(merged)[r]:
            assert 1 <= len(w.microbatches) <= group
            last = max(plain[r].index(Action(w.stage, "W", mb)) for mb in w.microbatches)
            before = [a for a in plain[r][:last] if a.kind != "W"]
            assert [a for a in merged[r][: merged[r].index(w)] if a.kind != "W"] == before
    # each stage's groups are full but for its last
    for acts in _ws(merged).values():
        for s in {a.stage for a in acts}:
            sizes = [len(a.microbatches) for a in acts if a.stage == s]
            assert all(n == min(group, 8) for n in sizes[:-1]), sizes


def test_merging_only_ws_and_one_group_is_the_plain_lists():
    plain = build_schedule("zb-h1", 2, 4, early_grad_send=True)
    assert merge_weights(plain, 1) == plain
    assert build_schedule("1f1b", 2, 4, merge_w=4) == build_schedule("1f1b", 2, 4)  # no W


def test_printed_and_csv_round_trip():
    lists = build_schedule("zb-h1", 2, 8, early_grad_send=True, merge_w=4)
    assert "1W0+1+2+3" in [str(a) for a in lists[1]]
    placement = placement_of("zb-h1", 2, 1)
    text = dump_csv(lists, simulate(lists, placement, sim_unit_costs(lists)).start)
    assert "1W4+5+6+7" in text
    back, placement_back, m = parse_csv(text, "t.csv")
    assert back == lists and placement_back == placement and m == 8
    validate(lower(back, placement), placement, 8)


@pytest.mark.parametrize(
    "cell, why",
    [
        ("0F1+2", "only a W merges"),
        ("0W1+", "is not an action"),
        ("0W1+99999", "an index above"),
    ],
)
def test_bad_merged_cells_are_refused(cell, why):
    with pytest.raises(ScheduleError, match=why):
        parse_csv(f"0F0,0F1,0I0,0I1,{cell}\n", "t.csv")


@pytest.mark.parametrize(
    "w, why",
    [
        (Action(0, "W", 0, merged=(0,)), "second W for stage 0 micro-batch 0"),
        (Action(0, "W", 0, merged=(2,)), "outside stages"),
        (Action(0, "B", 0, merged=(1,)), "only a W merges"),
    ],
)
def test_validate_refuses_bad_merges(w, why):
    acts = [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0), Action(0, "B", 1), w]
    if w.kind == "B":
        acts = acts[:3] + [w]
    placement = placement_of("1f1b", 1, 1)
    with pytest.raises(ScheduleError, match=why):
        validate({0: acts}, placement, 2)


def test_a_merged_w_before_a_members_b_is_refused():
    acts = [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0),
            Action(0, "W", 0, merged=(1,)), Action(0, "B", 1)]  # fmt: skip
    with pytest.raises(ScheduleError, match=r"runs before its B \(micro-batch 1\)"):
        validate({0: acts}, placement_of("1f1b", 1, 1), 2)


def test_the_simulator_costs_a_merged_w_and_keeps_its_caches_alive():
    placement = placement_of("zb-h1", 2, 1)
    plain = build_schedule("zb-h1", 2, 8, early_grad_send=True)
    merged = merge_weights(plain, 8)
    costs = Costs(forward=1.0, backward=1.0, weight=1.0, weight_more=0.5)
    sim = simulate(merged, placement, costs)
    for acts in merged.values():
        (w,) = [a for a in acts if a.kind == "W"]
        assert sim.end[w] - sim.start[w] == pytest.approx(1.0 + 7 * 0.5)
    # every micro-batch's W cache lives until the one W: 8 alive at once, not 2
    assert simulate(plain, placement, costs).peak_per_rank == [2.0, 2.0]
    assert sim.peak_per_rank == [8.0, 8.0]
    # without weight_more a merged W costs its micro-batches' W passes: the busy time is the same
    same = simulate(merged, placement, dataclasses.replace(costs, weight_more=None))
    assert sum(same.busy) == pytest.approx(sum(simulate(plain, placement, costs).busy))


def test_the_search_merges_where_the_costs_say_it_pays_and_the_limit_allows():
    cheap = dataclasses.replace(unit_costs(2), weight=(2.0,) * 4, weight_more=(1.0,) * 4)
    best = search(cheap, 2, 8, exact=False, max_inflight=8).best
    assert best.merged > 1 and best.found_by.endswith(f"W merged in {best.merged}s")
    ws = [a for acts in best.lists.values() for a in acts if a.kind == "W"]
    assert any(a.merged for a in ws)
    validate(best.lists, best.placement, 8)
    # the same costs without a merged W's: nothing to gain, no merge
    plain = dataclasses.replace(cheap, weight_more=())
    assert search(plain, 2, 8, exact=False, max_inflight=8).best.merged == 1
    # within 2 micro-batches of a rank's share no merge fits
    assert search(cheap, 2, 8, exact=False, max_inflight=2).best.merged == 1


def test_search_costs_check_a_merged_ws_seconds():
    with pytest.raises(CostsError, match="merged W"):
        check_values(dataclasses.replace(unit_costs(2), weight_more=(1.0,)))
    with pytest.raises(CostsError, match="merged W = -1"):
        check_values(dataclasses.replace(unit_costs(2), weight_more=(-1.0, 1.0, 1.0, 1.0)))


def test_the_schedule_value_and_a_traces_attributes_carry_the_merge():
    schedule = make_schedule("zb-h1", 2, 8, early_grad_send=True, merge_w=4)
    assert schedule.merge_w == 4
    assert any(a.merged for acts in schedule.compute.values() for a in acts)
    attrs = {"schedule": "zb-h1", "pp": 2, "microbatches": 8, "early_grad_send": True,
             "merge_w": 4}  # fmt: skip
    assert trace_schedule(attrs).compute == schedule.compute
    del attrs["merge_w"]  # a trace of before: none merged
    assert trace_schedule(attrs).merge_w == 1


def test_train_merge_w_below_one_is_refused():
    with pytest.raises(ConfigError, match="train.merge_w = 0: must be >= 1"):
        load_job(ROOT / "jobs" / "laptop.toml", ["train.merge_w=0"], 4)
    job = load_job(ROOT / "jobs" / "laptop.toml", ["train.merge_w=2", "train.schedule=zb-h1"], 4)
    assert job.schedule.merge_w == 2


def test_merge_ratios_follow_the_row_probes_line():
    from mpihybrid.predict.rows import merge_ratios

    # W = 1 ms + 0.01 ms a row: at 100 rows 2 ms, at 50 rows 1.5; a merged W pays the 1 ms once
    probe = ([100, 50], [1.0, 0.5, 1.0, 0.5, 2e-3, 1.5e-3] * 2)
    assert merge_ratios(probe, 4, 4, 2) == pytest.approx([0.5, 0.5])
    # at M = 8 (50 rows a micro-batch) the fixed part is more of a W: 0.5 / 1.5
    assert merge_ratios(probe, 4, 8, 2) == pytest.approx([1 / 3, 1 / 3])
    # a line that falls with the rows saves nothing; a probe of other chunks: None
    assert merge_ratios(([100, 50], [1.0, 0.5, 1.0, 0.5, 1e-3, 2e-3]), 4, 4, 1) == [1.0]
    assert merge_ratios(probe, 4, 4, 3) is None
