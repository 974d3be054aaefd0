"""Schedules as data: generators, validation, lowering, dry run, simulator vs closed forms."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from mpihybrid.pipeline.schedules import (
    SCHEDULES,
    Action,
    Placement,
    ScheduleError,
    build_schedule,
    check_config,
    chunks_for,
    dry_run,
    get_spec,
    lower,
    placement_of,
    validate,
)
from mpihybrid.pipeline.simulate import (
    Costs,
    bubble_formula,
    compare,
    describe,
    render_grid,
    simulate,
)

EQUAL = Costs(forward=1.0, backward=1.0, weight=1.0)  # F = B = W; an unsplit B costs 2


def legal_configs(name: str, pp: int):
    """(m, v) pairs over m = 1..16 (v = 2..3 where the spec lets virtual_stages choose) that
    check_config accepts."""
    for m in range(1, 17):
        for v in (2, 3) if get_spec(name).chunks == 0 else (chunks_for(name),):
            try:
                check_config(name, pp, m, v)
            except ScheduleError:
                continue
            yield m, v


def test_action_prints_like_torch_pipelining():
    assert str(Action(1, "F", 0)) == "1F0"
    assert str(Action(0, "B", 3)) == "0B3"
    assert str(Action(2, "W", 1)) == "2W1"
    assert str(Action(1, "SEND_F", 0, peer=2)) == "1SEND_F0"
    assert str(Action(2, "RECV_B", 3, peer=3)) == "2RECV_B3"


def test_placements_loop_and_v():
    assert Placement.loop(4, 2).stage_ranks == (0, 1, 2, 3, 0, 1, 2, 3)
    assert Placement.loop(3).stage_ranks == (0, 1, 2)
    v = Placement.v(4)
    assert v.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)  # rank r holds r and 2p-1-r
    assert [v.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert (v.chunks, v.num_stages, v.chunk_of(7), v.chunk_of(3)) == (2, 8, 1, 0)
    assert not v.crosses(3, 4) and v.crosses(4, 5)  # the turn of the V stays on rank 3
    assert placement_of("interleaved-1f1b", 4, 2) == Placement.loop(4, 2)


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_validates_and_dry_runs(name, pp):
    for m, v in legal_configs(name, pp):
        compute = build_schedule(name, pp, m, v)
        kinds = [a.kind for acts in compute.values() for a in acts]
        assert kinds.count("F") == kinds.count("B") == pp * v * m
        if name in ("zb-h1", "zb-h2", "zb-v"):  # every backward split into B and W
            assert kinds.count("W") == pp * v * m
        placement = placement_of(name, pp, v)
        lowered = lower(compute, placement)
        sends = sum(a.kind.startswith("SEND") for acts in lowered.values() for a in acts)
        hops = sum(placement.crosses(s, s + 1) for s in range(pp * v - 1))  # a V's turn: none
        assert sends == 2 * hops * m
        validate(lowered, placement, m)
        dry_run(lowered, placement, synchronous=False)


def test_lowering_places_send_after_producer_and_recv_before_consumer():
    lowered = lower(build_schedule("1f1b", 2, 2), Placement.loop(2))
    assert [str(a) for a in lowered[0]] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1",
    ]  # fmt: skip
    assert [str(a) for a in lowered[1]] == [
        "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1",
    ]  # fmt: skip
    assert {a.peer for a in lowered[0] if a.kind in ("SEND_F", "RECV_B")} == {1}
    assert {a.peer for a in lowered[1] if a.kind in ("RECV_F", "SEND_B")} == {0}


def test_early_grad_send_splits_only_backwards_whose_gradient_crosses_ranks():
    compute = build_schedule("1f1b", 2, 2, early_grad_send=True)
    assert compute[0] == build_schedule("1f1b", 2, 2)[0]  # stage 0 sends no gradient
    assert [str(a) for a in compute[1]] == ["1F0", "1B0", "1W0", "1F1", "1B1", "1W1"]
    assert [str(a) for a in lower(compute, Placement.loop(2))[1]] == [
        "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1W0", "1RECV_F1", "1F1", "1B1", "1SEND_B1", "1W1",
    ]  # fmt: skip
    # zero-bubble lists are split already; one rank hands its gradients over locally
    assert build_schedule("zb-h1", 4, 8, early_grad_send=True) == build_schedule("zb-h1", 4, 8)
    one_rank = build_schedule("interleaved-1f1b", 1, 3, 3)
    assert build_schedule("interleaved-1f1b", 1, 3, 3, early_grad_send=True) == one_rank


@pytest.mark.parametrize("name", SCHEDULES)
def test_early_grad_send_keeps_order_and_memory_and_never_slows(name):
    for pp in range(1, 6):
        for m, v in legal_configs(name, pp):
            plain = build_schedule(name, pp, m, v)
            early = build_schedule(name, pp, m, v, early_grad_send=True)
            for rank in plain:  # the same F and B in the same order: W is only added
                assert [a for a in early[rank] if a.kind != "W"] == [
                    a for a in plain[rank] if a.kind != "W"
                ]
            placement = placement_of(name, pp, v)
            dry_run(lower(early, placement), placement, synchronous=False)
            before, after = simulate(plain, placement, EQUAL), simulate(early, placement, EQUAL)
            assert after.peak_inflight == before.peak_inflight
            assert after.makespan <= before.makespan
    # 1F1B at pp=2, M=4 with F = B = W: the last stage's W no longer delays stage 0's B
    two = Placement.loop(2)
    assert simulate(build_schedule("1f1b", 2, 4), two, EQUAL).makespan == 15
    assert simulate(build_schedule("1f1b", 2, 4, early_grad_send=True), two, EQUAL).makespan == 14


def test_stages_on_one_rank_hand_over_locally():
    compute = build_schedule("interleaved-1f1b", 1, 3, 3)
    assert lower(compute, Placement.loop(1, 3)) == compute


def test_rendezvous_sends():
    # naive and GPipe never block on a send whose receiver is busy sending back
    for pp in range(1, 6):
        for m in (1, 2, 5):
            for name in ("naive", "gpipe"):
                placement = Placement.loop(pp)
                dry_run(lower(build_schedule(name, pp, m), placement), placement, synchronous=True)
    # 1F1B's warmup sends meet a neighbour that is itself sending: the runtime must post its
    # receives before it sends (buffered semantics), which is what the buffered dry run checks
    lowered = lower(build_schedule("1f1b", 4, 8), Placement.loop(4))
    dry_run(lowered, Placement.loop(4), synchronous=False)
    with pytest.raises(ScheduleError, match="deadlock with rendezvous sends"):
        dry_run(lowered, Placement.loop(4), synchronous=True)


# ---------------------------------------------------------------- mutated lists are rejected


def _mutated(name: str, pp: int, m: int, rank: int, edit) -> dict[int, list[Action]]:
    actions = build_schedule(name, pp, m)
    actions[rank] = edit(list(actions[rank]))
    return actions


def _swap(i: int, j: int):
    def edit(acts):
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    return edit


@pytest.mark.parametrize(
    "name, rank, edit, cell, rule",
    [
        ("1f1b", 1, lambda a: [x for x in a if str(x) != "1B2"], "[1F2]", "has no B"),
        ("1f1b", 2, lambda a: [x for x in a if str(x) != "2F3"], "[2B3]", "runs before its F"),
        ("gpipe", 0, _swap(0, 4), "[0B0]", "runs before its F"),
        ("gpipe", 0, _swap(1, 4), "[0B0]", "dependencies cannot be met"),  # needs 1B0 <- 0F1
        ("zb-h1", 0, _swap(3, 4), "[0W0]", "runs before its B"),
        ("naive", 1, lambda a: a + [a[0]], "[1F0]", "second F"),
        ("naive", 1, lambda a: a + [Action(0, "F", 0)], "[0F0]", "stage 0 lives on rank 0"),
        ("naive", 1, lambda a: a + [Action(1, "F", 9)], "[1F9]", "outside stages"),
    ],
)
def test_mutated_lists_are_rejected_with_the_cell_marked(name, rank, edit, cell, rule):
    actions = _mutated(name, 3, 4, rank, edit)
    with pytest.raises(ScheduleError) as err:
        validate(actions, Placement.loop(3), 4)
    text = str(err.value)
    assert rule in text
    marked = next(line for line in text.splitlines() if "<-- ERROR HERE" in line)
    assert cell in marked, text


def test_mutated_messages_are_rejected():
    three = Placement.loop(3)
    lowered = lower(build_schedule("1f1b", 3, 4), three)
    no_recv = {**lowered, 1: [a for a in lowered[1] if str(a) != "1RECV_F2"]}
    with pytest.raises(ScheduleError, match="has no matching RECV"):
        validate(no_recv, three, 4)
    with pytest.raises(ScheduleError, match="ERROR HERE") as err:
        dry_run(no_recv, three, synchronous=False)
    assert "1F2 waits for the output of F of stage 0 micro-batch 2" in str(err.value)
    wrong_peer = {**lowered, 0: lowered[0][:1] + [Action(0, "SEND_F", 0, 2)] + lowered[0][2:]}
    with pytest.raises(ScheduleError, match="needs peer = rank of stage 1, got 2"):
        validate(wrong_peer, three, 4)


# ---------------------------------------------------------------- simulator


@pytest.mark.parametrize("name", SCHEDULES)
def test_simulator_matches_closed_forms_on_equal_costs(name):
    for pp in range(1, 9):
        for m, v in legal_configs(name, pp):
            actions = build_schedule(name, pp, m, v)
            expected = bubble_formula(name, pp, m, v)
            for costs in (EQUAL,) if get_spec(name).splits_backward else (EQUAL, Costs(1, 1, 0)):
                got = simulate(actions, placement_of(name, pp, v), costs).bubble_fraction
                assert got == pytest.approx(expected, abs=1e-12), (pp, m, v, costs)


def test_zb_h1_idles_a_third_of_1f1b():
    for pp in range(2, 9):
        for m in range(pp, 17):
            zb = simulate(build_schedule("zb-h1", pp, m), Placement.loop(pp), EQUAL)
            one_f_one_b = simulate(build_schedule("1f1b", pp, m), Placement.loop(pp), EQUAL)
            assert sum(zb.idle) == pytest.approx(sum(one_f_one_b.idle) / 3)


@pytest.mark.parametrize("pp", range(2, 9))
def test_bubble_ordering(pp):
    for m in (pp, 2 * pp):
        bubble = {
            name: simulate(
                build_schedule(name, pp, m, 2 if "inter" in name else 1),
                placement_of(name, pp, 2 if "inter" in name else 1),
                EQUAL,
            ).bubble_fraction
            for name in ("naive", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
        }
        assert bubble["naive"] > bubble["gpipe"] > bubble["interleaved-1f1b"] > bubble["zb-h1"]
        assert bubble["gpipe"] == pytest.approx(bubble["1f1b"])


def test_peak_activations_in_flight():
    for pp in range(1, 9):
        for m in range(1, 17):
            loop = Placement.loop(pp)
            one_f_one_b = simulate(build_schedule("1f1b", pp, m), loop).peak_inflight
            assert one_f_one_b == [min(pp - s, m) for s in range(pp)]
            assert simulate(build_schedule("gpipe", pp, m), loop).peak_inflight[0] == m
            assert simulate(build_schedule("naive", pp, m), loop).peak_inflight == [1] * pp
            zb = simulate(build_schedule("zb-h1", pp, m), loop).peak_inflight
            assert max(zb) <= max(one_f_one_b)


def test_simulator_timings_with_per_stage_costs_and_latency():
    costs = Costs(forward=[1.0, 2.0], backward=[3.0, 4.0], weight=0.5, send=0.5)
    result = simulate(build_schedule("gpipe", 2, 1), Placement.loop(2), costs)
    # 0F0 [0,1] -> 1F0 [1.5,3.5] -> 1B0 [3.5,8] -> 0B0 [8.5,12]; an unsplit B also pays W
    assert result.start[Action(1, "F", 0)] == 1.5
    assert result.start[Action(0, "B", 0)] == 8.5
    assert result.makespan == 12.0
    assert result.busy == [4.5, 6.5]
    assert result.idle == [7.5, 5.5]
    assert result.bubble_fraction == pytest.approx(13 / 24)
    split = simulate(build_schedule("zb-h1", 1, 1), Placement.loop(1), Costs(1.0, 2.0, 3.0))
    assert (split.start[Action(0, "W", 0)], split.makespan) == (3.0, 6.0)


def test_simulator_gap_tail_and_whole_backward():
    # zb-h1 on one rank, m=2: F0 B0 W0 F1 B1 W1; W1 is the stage's last weight-gradient action
    costs = Costs(1.0, 2.0, 3.0, tail=0.5, gap=0.25)
    result = simulate(build_schedule("zb-h1", 1, 2), Placement.loop(1), costs)
    assert result.start[Action(0, "B", 0)] == 1.25  # F0 [0,1], then the gap
    assert result.start[Action(0, "W", 1)] == 10.25
    assert result.makespan == 13.75  # W1 costs 3 + 0.5
    assert result.busy == [12.5] and result.idle == [1.25]  # five gaps are idle, not busy
    # dualpipev mixes whole and split backwards on a stage: each pays its own cost
    actions = build_schedule("dualpipev", 2, 4, 2)
    split = {(a.stage, a.microbatch) for acts in actions.values() for a in acts if a.kind == "W"}
    for whole, expected in ((None, 2.0), (5.0, 5.0)):
        result = simulate(actions, Placement.v(2), Costs(1.0, 1.0, 1.0, whole=whole))
        kinds = {
            ((a.stage, a.microbatch) in split, result.end[a] - result.start[a])
            for a in result.start
            if a.kind == "B"
        }
        assert kinds == {(True, 1.0), (False, expected)}


# ---------------------------------------------------------------- configs, grids, reports


@pytest.mark.parametrize(
    "name, pp, m, v, rule",
    [
        ("interleaved-1f1b", 4, 6, 2, "num_microbatches % pp == 0: 6 % 4 = 2"),
        ("interleaved-1f1b", 2, 4, 1, "virtual_stages >= 2 model chunks per rank, got 1"),
        ("1f1b", 2, 4, 2, "virtual_stages must be 1, got 2"),
        ("zb-h1", 2, 4, 3, "virtual_stages must be 1, got 3"),
        ("zb-v", 2, 4, 3, "zb-v runs 2 model chunks per rank: virtual_stages must be 2, got 3"),
        ("dualpipev", 4, 6, 2, "dualpipev needs num_microbatches >= 8 at pp=4, got 6"),
        ("csv:/nonexistent/zbv.csv", 2, 4, 2, "/nonexistent/zbv.csv"),
        ("pipedream", 2, 4, 1, "unknown schedule 'pipedream'"),
        ("gpipe", 0, 4, 1, "pp must be >= 1, got pp=0"),
        ("naive", 2, 0, 1, "num_microbatches must be >= 1, got 0"),
    ],
)
def test_illegal_configs_name_the_rule(name, pp, m, v, rule):
    with pytest.raises(ScheduleError, match=re.escape(rule)):
        check_config(name, pp, m, v)
    with pytest.raises(ScheduleError, match=re.escape(rule)):
        build_schedule(name, pp, m, v)


def test_render_grid_of_a_unit_cost_run():
    assert render_grid(build_schedule("gpipe", 2, 2), Placement.loop(2)) == "\n".join(
        [
            "        rank 0  rank 1",
            "step 0: F0      -",
            "step 1: F1      F0",
            "step 2: -       F1",
            "step 3: -       B0",
            "step 4: B0      B1",
            "step 5: B1      -",
        ]
    )
    interleaved = render_grid(build_schedule("interleaved-1f1b", 2, 2, 2), Placement.loop(2, 2))
    assert "3F0" in interleaved and "0B1" in interleaved


def test_describe_and_compare():
    text = describe("zb-h1", 4, 8)
    assert "W7" in text and "(p-1+d)/(3m+p-1+d)" in text
    assert "peak activations in flight per stage: s0:4 s1:4 s2:4 s3:4" in text
    table = compare(4, 6, 2).splitlines()
    rows = {line.split()[0]: line for line in table[3:]}
    assert list(rows) == list(SCHEDULES)
    assert "not legal" in rows["interleaved-1f1b"]
    assert rows["1f1b"].split()[-1] == "4" and rows["gpipe"].split()[-1] == "6"


def test_split_backwards_of_one_rank_or_of_every_rank():
    from mpihybrid.pipeline.actions import split_backwards

    zb = build_schedule("zb-h1", 2, 3)
    assert split_backwards(zb) == {(s, mb) for s in range(2) for mb in range(3)}
    assert split_backwards(zb[1]) == {(1, mb) for mb in range(3)}
    assert split_backwards(build_schedule("1f1b", 2, 3)) == set()


def test_a_message_waits_for_its_link_while_the_one_before_holds_it():
    """GPipe at pp 2, M 2, F = B = 1 and a hop of 3 that holds the link all along: stage 0's
    second activation leaves at 2 but its link is busy until 4, so it starts stage 1 at 7, not
    5; stage 1's second gradient likewise waits for the first (stage 0's B1 at 15, not 11)."""
    acts, pl = build_schedule("gpipe", 2, 2), placement_of("gpipe", 2)
    free = simulate(acts, pl, Costs(forward=1.0, backward=1.0, weight=0.0, send=3.0))
    wired = simulate(acts, pl, Costs(forward=1.0, backward=1.0, weight=0.0, send=3.0, wire=3.0))

    def starts(sim):
        return {str(a): t for a, t in sim.start.items()}

    assert (starts(free)["1F1"], starts(free)["0B1"], free.makespan) == (5.0, 11.0, 12.0)
    assert (starts(wired)["1F1"], starts(wired)["0B1"], wired.makespan) == (7.0, 15.0, 16.0)


def test_one_wire_for_both_ways_makes_activations_and_gradients_meet():
    """1F1B at pp 2, M 4 (F = B = 1, a hop of 3 holding its link): on a full-duplex link only
    messages going the same way queue (23 against 22 unlinked); sharing one wire both ways, a
    gradient waits for an activation too (stage 0's B0 at 10, not 9: 26)."""
    acts, pl = build_schedule("1f1b", 2, 4), placement_of("1f1b", 2)
    costs = Costs(forward=1.0, backward=1.0, weight=0.0, send=3.0)
    duplex = simulate(acts, pl, replace(costs, wire=3.0))
    shared = simulate(acts, pl, replace(costs, wire=3.0, shared_wire=True))
    assert (simulate(acts, pl, costs).makespan, duplex.makespan, shared.makespan) == (22, 23, 26)
    assert {str(a): t for a, t in shared.start.items()}["0B0"] == 10.0
