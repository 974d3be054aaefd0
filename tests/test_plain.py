"""analyze's first lines say in plain words what the figures mean (mpihybrid/analysis/plain.py):
the bubble against the formula, and which of oversubscription, message latency, the schedule or
unequal costs sets it. Figures are given, not timed."""

from __future__ import annotations

import numpy as np
import pytest

from mpihybrid.analysis.metrics import analyze
from mpihybrid.analysis.plain import fraction_words, plain_lines
from mpihybrid.analysis.report import format_analysis
from mpihybrid.pipeline.schedules import build_schedule, placement_of
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.trace.file import Trace
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND


@pytest.mark.parametrize(
    "x, words",
    [(0.0, "none"), (0.21, "about a fifth"), (0.2, "about a fifth"), (0.82, "about four fifths"),
     (0.5, "about half"), (0.34, "about a third"), (0.03, "about a twentieth"), (1.0, "all")],
)  # fmt: skip
def test_fraction_words(x, words):
    assert fraction_words(x) == words


def result(measured=0.21, predicted=0.22, forward=3e-3, send=5e-5, over=None, pp=2) -> dict:
    run = {"schedule": "1f1b", "pp": pp, "dp": 2, "microbatches": 4, "oversubscribed": over}
    costs = {"forward": [forward, 0.0 if pp == 1 else forward], "send": send}
    bubble = {"measured": measured, "predicted": predicted, "formula": 0.2, "costs": costs}
    return {"run": run, "bubble": bubble}


def test_near_the_formula_says_the_schedule_sets_the_idle_time():
    head, why = plain_lines(result())
    assert head == (
        "in short        bubble 0.21 measured vs 0.20 for 1f1b at pp=2, M=4: the stages idle "
        "about a fifth of each step waiting on each other"
    )
    assert why.strip() == (
        "near the formula: a forward takes 3.00 ms per micro-batch and a message 0.05 ms, so "
        "the schedule, not the messages, sets the idle time"
    )


def test_latency_bound_says_the_messages_set_the_idle_time():
    # the quick start before #41: a 0.15 ms forward against hops as long
    _, why = plain_lines(result(measured=0.853, predicted=0.942, forward=1.5e-4, send=1.2e-4))
    assert why.strip().startswith("latency bound: a forward takes 0.15 ms per micro-batch")
    assert "the messages, not the schedule, set the idle time" in why


def test_oversubscribed_says_the_machine_is_measured():
    over = {"host": "laptop", "ranks": 4, "cores": 2}
    head, why = plain_lines(result(measured=0.5, over=over))
    assert "idle about half of each step" in head
    assert why.strip().startswith("oversubscribed: 4 ranks on 2 cores")
    assert "measures the machine more than the schedule" in why and "mpiexec -n 2" in why


def test_away_from_the_formula_names_the_simulated_figure():
    _, why = plain_lines(result(measured=0.40, predicted=0.38))
    assert why.strip().startswith("above the formula")
    assert "simulated with this run's own costs the bubble is 0.38" in why
    _, why = plain_lines(result(measured=0.05, predicted=0.06))
    assert why.strip().startswith("below the formula")


def test_one_stage_has_no_bubble_to_explain():
    (line,) = plain_lines(result(measured=0.0, pp=1))
    assert "one pipeline stage (pp=1): no rank waits on another stage" in line


def test_analyze_prints_them_first():
    # a trace laid out by the simulator: no message latency, measured == formula
    actions = build_schedule("1f1b", 2, 4, 1)
    placement = placement_of("1f1b", 2, 1)
    sim = simulate(actions, placement, Costs(3e-3, 6e-3, 0.0))
    code = {"F": "forward", "B": "backward"}
    events = []
    for step, origin in ((0, 0.0), (1, 1.0), (2, 2.0)):
        for a, t in sim.start.items():
            row = (placement.rank_of(a.stage), a.stage, 0, KIND[code[a.kind]], step,
                   a.microbatch, origin + t, origin + sim.end[a], 0, -1, np.nan)  # fmt: skip
            events.append(row)
    ev = np.array(events, dtype=EVENT_DTYPE)
    config = {"pp": 2, "dp": 1, "schedule": "1f1b", "microbatches": 4}
    lines = format_analysis(analyze(Trace(ev[np.argsort(ev["start"])], {}, "", config)))
    lines = lines.splitlines()
    assert lines[0].startswith("== 1f1b, pp=2 x dp=1, M=4")
    assert lines[1].startswith("in short        bubble 0.20 measured vs 0.20 for 1f1b")
    assert lines[2].strip().startswith("near the formula: a forward takes 3.00 ms per micro")
