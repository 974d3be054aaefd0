"""model.vocab_parallel in training: == serial (every nanoGPT-named tensor, gathered from the
shares) under 1F1B and V-Half at pp 2, 3 and 4, dp 1 and 2, auto at pp 2, tied and untied,
data.vocab = 37 padded to a multiple of pp; replicas bit-identical under the int8 codec; the
passes are schedule actions that validate and dry-run; one line per bad setting."""

from __future__ import annotations

import pytest

from mpihybrid.config import ConfigError, load_job
from mpihybrid.pipeline.schedules import build_schedule, dry_run, lower, placement_of, validate
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.pipeline.vocab_passes import add_vocab_passes
from tests.helpers import results, run_mpi

TINY_GPT = ["model.kind=gpt", "model.hidden=16", "model.heads=2", "model.ffn=32",
            "model.depth=4", "data.vocab=37", "data.seq_len=8", "data.test_samples=4",
            "data.kind=markov", "train.steps=3", "comm.codec=fp32", "train.optimizer=sgd",
            "train.lr=0.1", "model.vocab_parallel=true"]  # fmt: skip
TIED = "model.tie_embeddings=true"


def _argv(settings):
    return [arg for s in settings for arg in ("--set", s)]


@pytest.mark.parametrize("name, pp, m", [("1f1b", 2, 4), ("1f1b", 4, 8), ("v-half", 3, 6),
                                         ("zb-h1", 3, 3), ("interleaved-1f1b", 2, 4)])  # fmt: skip
def test_the_passes_are_actions_that_validate_and_run(name, pp, m):
    v = 2 if name in ("v-half", "interleaved-1f1b") else 1
    placement = placement_of(name, pp, v)
    costs = Costs(1.0, 1.0, 1.0, vocab={"E": 0.1, "S": 1.0, "T": 2.0, "G": 0.1})
    lists = add_vocab_passes(build_schedule(name, pp, m, v, True), placement, m, costs, simulate)
    validate(lists, placement, m)
    dry_run(lower(lists, placement), placement, synchronous=False)
    for r, acts in lists.items():
        assert [str(a) for a in acts if a.kind == "S"] == [f"{r}S{mb}" for mb in range(m)]
    result = simulate(lists, placement, costs)
    # every rank does its share of the head: the same busy time where the stages are balanced
    print(name, pp, "busy", result.busy, "makespan", result.makespan)
    assert max(result.busy) - min(result.busy) < 1e-9 or name == "zb-h1"


def _check(runs, names, also=("", TIED)):
    assert [(r["schedule"], r["also"]) for r in runs] == [(n, a) for a in also for n in names]
    for r in runs:
        print(f"{r['schedule']} {r['also']}: max |hybrid - serial| = {r['max_abs_diff']:.2e}")
        assert r["max_abs_diff"] < 1e-5, r
        assert r["losses"] == pytest.approx(r["serial_losses"], rel=1e-5)
        assert r["replica_max_diff"] == 0.0


@pytest.mark.mpi
@pytest.mark.parametrize(
    "pp, dp, names",
    [(2, 1, ["1f1b", "v-half", "auto"]), (3, 1, ["1f1b", "v-half"]), (2, 2, ["1f1b", "v-half"]),
     (4, 1, ["1f1b", "v-half"])],
)  # fmt: skip
def test_vocab_parallel_equals_serial(pp, dp, names):
    m = 2 * pp
    # auto: a deterministic second of exact search per search (4 by default)
    settings = [*TINY_GPT, f"grid.pp={pp}", f"grid.dp={dp}", f"train.microbatches={m}",
                f"train.global_batch={2 * m * dp}", f"model.depth={2 * pp - 2}",
                "train.schedule_time=1"]  # fmt: skip
    proc = run_mpi(pp * dp, "tests/_mpi_train.py", "--serial", "--schedules", ",".join(names),
                   "--also", TIED, *_argv(settings), timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    _check(results(proc), names)


@pytest.mark.mpi
def test_vocab_parallel_replicas_identical_under_int8():
    settings = [*TINY_GPT, "grid.pp=2", "grid.dp=2", "train.microbatches=2",
                "train.global_batch=8", "comm.codec=int8", "comm.bucket_kb=1"]  # fmt: skip
    proc = run_mpi(4, "tests/_mpi_train.py", "--schedules", "1f1b", "--also", TIED,
                   *_argv(settings), timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = results(proc)
    assert len(runs) == 2 and all(r["replica_max_diff"] == 0.0 for r in runs)


@pytest.mark.parametrize(
    "settings, world, says",
    [
        (
            ["model.kind=llama", "grid.pp=2"],
            2,
            r"model.vocab_parallel = true: a gpt's setting \(model.kind = 'llama' does not",
        ),
        (["grid.pp=1"], 1, "model.vocab_parallel needs grid.pp >= 2"),
    ],
)
def test_bad_vocab_parallel_is_one_config_error(settings, world, says):
    with pytest.raises(ConfigError, match=says):
        load_job(None, [*TINY_GPT, *settings], world)


def test_schedule_show_draws_the_passes():
    from mpihybrid.pipeline.simulate import describe

    text = describe("v-half", 2, 4, 2, vocab=True)
    assert "0S0" in text and "1T3" in text and "S the vocabulary share's logits" in text


def test_schedule_show_all_counts_the_passes_and_csv_is_one_line(tmp_path):
    from tests.test_cli_trace import cli_here, failed

    plain = cli_here("schedule", "show", "--all", "--pp", "3", "-m", "6")
    proc = cli_here("schedule", "show", "--all", "--pp", "3", "-m", "6", "--vocab-parallel")
    assert proc.returncode == 0 and "vocab_parallel's passes placed" in proc.stdout

    def simulated(text: str) -> float:  # 1F1B's simulated bubble
        row = next(line for line in text.splitlines() if line.startswith("1f1b "))
        return float(row.split()[5])

    # at pp = 3, m = 6 the passes fill 1F1B's bubble (0.250 without them)
    assert simulated(plain.stdout) == 0.25 and simulated(proc.stdout) < 0.2
    out = tmp_path / "s.csv"
    proc = cli_here("schedule", "show", "--pp", "2", "--vocab-parallel", "--csv", out)
    assert failed(proc, "torch's CSV has no E/S/T/G passes") and not out.exists()


def test_the_search_judges_its_candidates_with_the_passes():
    """auto's search: each candidate simulated with the vocabulary passes placed on it."""
    import dataclasses

    from mpihybrid.pipeline.search import search
    from mpihybrid.pipeline.search_costs import unit_costs

    base = unit_costs(2)
    plain = search(base, 2, 4, exact=False)
    vocab = search(dataclasses.replace(base, vocab=(0.0, 1.0, 2.0, 0.0)), 2, 4, exact=False)
    assert any(a.kind == "S" for a in vocab.best.sim.start)
    # every rank runs 4 S and 4 T: 12 units more of its own work
    assert max(vocab.best.sim.busy) == pytest.approx(max(plain.best.sim.busy) + 12)


def test_the_greedy_keeps_its_fastest_order_with_the_passes_placed():
    """best_greedy: its fastest few orders judged with the passes placed, the fastest kept; no
    slower than placing them on the order it picks without them."""
    import dataclasses

    from mpihybrid.pipeline.search_greedy import best_greedy

    placement = placement_of("1f1b", 3)
    costs = Costs(1.0, 1.0, 1.0, vocab={"E": 0.0, "S": 1.0, "T": 2.0, "G": 0.0})
    lists, sim = best_greedy(placement, 6, costs, max_inflight=3.0)
    assert any(a.kind == "T" for a in sim.start) and not any(
        a.kind == "T" for acts in lists.values() for a in acts
    )
    plain, _ = best_greedy(placement, 6, dataclasses.replace(costs, vocab=None), max_inflight=3.0)
    placed = add_vocab_passes(plain, placement, 6, costs, simulate)
    assert sim.makespan <= simulate(placed, placement, costs).makespan + 1e-9


def test_the_exact_search_orders_around_the_passes():
    """search_exact: the passes are intervals of the model (its makespan holds every rank's 4 S
    and 4 T); the lists it returns hold F, B and W alone, valid."""
    pytest.importorskip("ortools")
    from mpihybrid.pipeline.search_exact import solve

    placement = placement_of("1f1b", 2)
    costs = Costs(1.0, 1.0, 1.0, vocab={"E": 0.0, "S": 1.0, "T": 2.0, "G": 0.0})
    plain = solve(placement, 4, Costs(1.0, 1.0, 1.0), limit=[2, 2], time_limit=10,
                  deterministic=True)  # fmt: skip
    found = solve(placement, 4, costs, limit=[2, 2], time_limit=10, deterministic=True)
    assert found.lists and {a.kind for acts in found.lists.values() for a in acts} == set("FBW")
    validate(found.lists, placement, 4)
    # a rank's own work: 4 x (F + B + W) and 4 x (S + T)
    assert plain.makespan < 24 <= found.makespan + 1e-9


def test_the_exact_bound_counts_the_passes_and_the_hint_is_the_run():
    """search_exact with the passes: its proven bound holds each rank's passes (a rank's own work,
    4 x (F + B + W) + 4 x (S + T) = 24, at any time limit); the hint, placed with the passes as
    training places them, is a whole solution, so the V at pp 2 (whose hint once left the passes
    unset: no solution in the limit) ends with one proved within the 1 % auto asks."""
    pytest.importorskip("ortools")
    from mpihybrid.config.searched import AUTO_GAP
    from mpihybrid.pipeline.search_exact import solve

    costs = Costs(1.0, 1.0, 1.0, vocab={"E": 0.0, "S": 1.0, "T": 2.0, "G": 0.0})
    loop = placement_of("1f1b", 2)
    hint = build_schedule("zb-h1", 2, 4, 1, True)
    early = solve(loop, 4, costs, limit=[2, 2], time_limit=1e-3, deterministic=True, hint=hint)
    assert early.bound >= 24 - 1e-9
    v = placement_of("v-half", 2, 2)
    hint = build_schedule("v-half", 2, 4, 2, True)
    found = solve(v, 4, costs, limit=[4, 4], time_limit=1.0, deterministic=True, hint=hint,
                  gap_limit=AUTO_GAP)  # fmt: skip
    assert found.lists and found.gap <= AUTO_GAP + 1e-9, found
    # the hint as training runs it (passes placed) is no better than what the solve returned
    placed = simulate(add_vocab_passes(hint, v, 4, costs, simulate), v, costs)
    assert found.makespan <= placed.makespan + 1e-9
    if found.status == "optimal":
        assert found.bound == pytest.approx(found.makespan)
