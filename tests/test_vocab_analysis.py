"""analyze and whatif on model.vocab_parallel traces: the E/S/T/G passes are actions with their
measured costs (analysis/costs.py), links of the critical path, busy time for idle by cause, and
the replay runs the lists as they ran. A trace laid out by the simulator gives its makespan back
exactly; a real run's passes appear where they ran."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpihybrid.analysis.costs import stage_costs
from mpihybrid.analysis.critical import critical_paths, shares
from mpihybrid.analysis.export import event_name
from mpihybrid.analysis.idle import attribute_idle
from mpihybrid.analysis.lanes import Lanes
from mpihybrid.analysis.replay import Change, Measured, gain_table, replay
from mpihybrid.pipeline.schedules import build_schedule, placement_of
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.pipeline.vocab_passes import VOCAB_KINDS, add_vocab_passes, vocab_inputs
from mpihybrid.trace.read import Trace, load
from tests.helpers import run_mpi
from tests.test_cli_trace import cli_here
from tests.test_vocab_train import TINY_GPT, _argv
from tests.test_why import rows

KIND_NAME = {"F": "forward", "B": "backward", "W": "weight", "E": "vocab_embed",
             "S": "vocab_logits", "T": "vocab_grad", "G": "vocab_embed_grad"}  # fmt: skip
# rank 1's E slower: the first stage's F waits inside its row for its part
VOCAB = {"E": [0.1, 0.6], "S": [1.0, 0.8], "T": [2.0, 1.2], "G": [0.1, 0.1], "tail": [0.3, 0.5]}


def vocab_trace(pp: int = 2, m: int = 4, steps: int = 3):
    """A 1F1B trace with the passes placed, laid out by simulate() as the runtime records it:
    a pass's receives (stage -1, one per other share, in rank order) before its row; the first
    stage's F and the last stage's B wait for the shares' parts inside their own row."""
    placement = placement_of("1f1b", pp)
    costs = Costs(forward=[1.0, 1.5], backward=1.0, weight=0.5, vocab=VOCAB)
    lists = add_vocab_passes(build_schedule("1f1b", pp, m, 1, True), placement, m, costs, simulate)
    sim = simulate(lists, placement, costs)
    end_of = {(a.kind, a.stage, a.microbatch): t for a, t in sim.end.items()}
    rank_of = {a: r for r, acts in lists.items() for a in acts}
    last, spec = placement.num_stages - 1, []
    for step in range(steps):
        origin, free = 100.0 * step, {}
        for r in range(pp):
            spec.append((r, -1, "step", step, -1, origin, origin + sim.makespan, -1))
        for a in sorted(sim.start, key=lambda a: sim.start[a]):
            rank, mb = rank_of[a], a.microbatch
            begin, start = free.get(rank, origin), origin + sim.start[a]
            src = a.stage - 1 if a.kind == "F" else a.stage + 1
            if a.kind in "FB" and 0 <= src <= last and placement.rank_of(src) != rank:
                peer, t = placement.rank_of(src), origin + end_of[(a.kind, src, mb)]
                spec.append((peer, src, "send", step, mb, t, t, rank))
                spec.append((rank, a.stage, "recv", step, mb, begin, start, peer))
            cursor = begin
            for key in vocab_inputs(a, last, pp):
                peer = key[1] if key[0] in VOCAB_KINDS else placement.rank_of(key[1])
                if peer != rank:
                    until = max(cursor, origin + end_of[key])
                    spec.append((rank, -1, "recv", step, mb, cursor, until, peer))
                    cursor = until
            nested = a.kind in "FB" and cursor > begin
            stage = a.stage if a.kind in "FBW" else -1
            spec.append((rank, stage, KIND_NAME[a.kind], step, mb, begin if nested else start,
                         origin + sim.end[a], -1))  # fmt: skip
            free[rank] = origin + sim.end[a]
    events = rows(spec)
    attrs = {"pp": pp, "dp": 1, "world_size": pp, "microbatches": m, "schedule": "1f1b",
             "early_grad_send": True, "virtual_stages": 1}  # fmt: skip
    return Trace(events[np.argsort(events["start"], kind="stable")], {}, "", attrs), sim


def test_the_passes_costs_are_measured_per_share():
    trace, _ = vocab_trace()
    costs = stage_costs(trace.events, 2)
    # the F and B that waited inside their rows for the shares cost their own work alone
    assert costs["forward"] == pytest.approx([1.0, 1.5])
    assert costs["backward"] == pytest.approx([1.5, 1.0])  # stage 0: whole backwards
    assert costs["weight"] == pytest.approx([0.0, 0.5])
    for kind, values in VOCAB.items():
        assert costs["vocab"][kind] == pytest.approx(values)


def test_a_simulated_vocab_trace_replays_exactly_and_its_path_names_the_passes():
    trace, sim = vocab_trace()
    base = Measured.of(trace)
    assert base.lists is not None and any(a.kind == "T" for a in base.lists[0])
    assert replay(base, Change())["phase"] == pytest.approx(sim.makespan)
    # halving every T pass shortens the step; the gain table lists the passes
    assert replay(base, Change(scales={("all", -1, "T"): 0.5}))["phase"] < sim.makespan
    assert any("vocabulary T" in row["what"] for row in gain_table(base))
    lanes = Lanes.of(trace.events)
    for path in critical_paths(lanes, [1, 2]):
        assert path.seconds == pytest.approx(sim.makespan)
        assert all(k.kind != "gap" for k in path.links)
    named = shares(critical_paths(lanes, [1, 2]))
    assert sum(named.values()) == pytest.approx(1.0)
    assert any(k.startswith("vocab T v") for k in named) and "runtime" not in named
    idle = attribute_idle(lanes, [1, 2])
    for r, row in enumerate(idle["ranks"]):  # the passes are busy time
        assert row["idle"] == pytest.approx(2 * sim.idle[r])
        assert row["attributed"] == pytest.approx(row["idle"])


@pytest.mark.mpi
def test_analyze_and_whatif_of_a_real_vocab_parallel_run(tmp_path):
    # pp 2 x dp 2, data-inner (a replica's ranks 0 and 2): the shares by pp rank, their rings
    path = tmp_path / "vocab.h5"
    settings = [*TINY_GPT, "grid.pp=2", "grid.dp=2", "grid.order=data-inner",
                "train.microbatches=4", "train.steps=4"]  # fmt: skip
    proc = run_mpi(4, "-m", "mpihybrid", "train", "--quiet", "--trace", str(path),
                   *_argv(settings))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = cli_here("analyze", path, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    # every chunk's ring has its size: the stages' and the two shares' (chunks 2 and 3)
    rings = {row["stage"]: row["size_bytes"] for row in doc["allreduce"]}
    assert sorted(rings) == [0, 1, 2, 3] and rings[2] == rings[3] > 0
    named = doc["why"]["critical"]["shares"]
    assert any(k.startswith("vocab ") for k in named), named
    for row in doc["why"]["idle"]["ranks"]:
        assert row["attributed"] == pytest.approx(row["idle"], rel=0.02)
    costs = doc["bubble"]["costs"]["vocab"]
    assert set(costs) == {"E", "S", "T", "G", "tail"}
    assert all(x > 0 for k in "ESTG" for x in costs[k])
    trace = load(path)
    assert {"E0", "S3", "T1", "G2"} <= {event_name(e) for e in trace.events}  # export's names
    base = Measured.of(trace)
    ran = {r: "".join(a.kind for a in acts) for r, acts in base.lists.items()}
    assert all(acts.count(k) == 4 for acts in ran.values() for k in "ESTG"), ran
    out = json.loads(cli_here("whatif", path, "--json").stdout)
    assert out["replayed"]["phase"] > 0
    out = json.loads(cli_here("whatif", path, "--set", "schedule=gpipe", "--json").stdout)
    assert out["predicted"]["phase"] > 0 and out["change"] == "schedule=gpipe"
