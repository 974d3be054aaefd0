"""Numbers a user can type as a limit (issue 53): inf, 1e30, 1e400 mean "no limit" to `schedule
search` and train.schedule_inflight; 0, NaN and negatives are one line, exit 2; the --csv messages
name the path once, with --overwrite only where it helps."""

from __future__ import annotations

import importlib.util

import pytest
from click.testing import CliRunner

from mpihybrid.cli import main
from mpihybrid.config import ConfigError, build_job, resolve
from mpihybrid.pipeline.search import search
from mpihybrid.pipeline.search_costs import unit_costs

SEARCH = ["schedule", "search", "--pp", "2", "-m", "4", "--no-grid", "--time-limit", "2"]


def _search(*args: str):
    return CliRunner().invoke(main, [*SEARCH, *args])


@pytest.mark.parametrize("value", ["inf", "1e30", "1e400", "Infinity"])
def test_max_inflight_beyond_m_is_no_limit(value):
    result = _search("--max-inflight", value)
    assert result.exit_code == 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "at most 4 micro-batches of a rank's share alive per rank (all of them: no limit)" in (
        result.output
    )


@pytest.mark.parametrize("value", ["inf", "1e400", "INF"])
def test_memory_inf_is_no_limit(value):
    result = _search("--job", "jobs/seed_k3_d4.toml", "--memory", value, "--no-exact")
    assert result.exit_code == 0, result.output
    assert "(all of them: no limit)" in result.output


@pytest.mark.parametrize(
    "args, says",
    [
        (["--pp", "0"], "--pp 0: must be between 1 and 64"),
        (["-m", "0"], "--microbatches 0: must be between 1 and 512"),
        (["--max-inflight", "nan"], "a memory limit of nan"),
        (["--max-inflight", "0"], "a memory limit of 0"),
        (["--job", "jobs/seed_k3_d4.toml", "--memory", "nan"], "--memory 'nan'"),
    ],
)
def test_zero_and_nan_are_one_line(args, says):
    result = _search(*args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.output.strip().count("\n") == 0 and says in result.output, result.output


def test_csv_messages_name_the_path_once(tmp_path):
    there = tmp_path / "there.csv"
    there.write_text("mine\n")
    result = _search("--csv", str(there))
    assert result.exit_code == 2
    assert result.output.count("--overwrite") == 1 and result.output.count(str(there)) == 1
    missing = tmp_path / "no" / "x.csv"
    result = _search("--csv", str(missing))
    assert result.exit_code == 2 and "--overwrite" not in result.output, result.output
    assert "does not exist" in result.output and there.read_text() == "mine\n"


def test_search_clamps_an_infinite_limit_to_m():
    result = search(unit_costs(2), 2, 4, max_inflight=float("inf"), exact=False)
    assert result.max_inflight == 4.0


@pytest.mark.parametrize("value, ok", [("inf", 1), ("1e30", 1), ("nan", 0), ("0.5", 0)])
def test_schedule_inflight_setting(value, ok):
    sets = ["grid.pp=2", "grid.dp=1", "train.schedule=auto", f"train.schedule_inflight={value}"]
    if ok:
        assert resolve(build_job({}, sets), 2).train.schedule_inflight >= 1e30
    else:
        with pytest.raises(ConfigError, match="train.schedule_inflight"):
            resolve(build_job({}, sets), 2)


@pytest.mark.skipif(
    importlib.util.find_spec("ortools") is None, reason="the exact search needs OR-Tools"
)
@pytest.mark.parametrize("gap", [0.0, 0.3])
def test_the_proven_bound_is_below_every_simulated_builtin(gap):
    """The exact search proves under the simulator's timing (issue 53): a rank's gap between
    two actions, not after each (the model once added it to every action, its last and its
    dependencies too, and proved a bound above steps its own built-ins table simulated)."""
    import dataclasses

    costs = dataclasses.replace(unit_costs(2), gap=gap, send=0.1)
    result = search(costs, 2, 4, max_inflight=4, time_limit=10, deterministic=True)
    assert result.status == "optimal" and result.bound > 0
    slack = 1e-3 * result.bound  # the model's costs are rounded to a thousandth of the longest
    assert result.bound <= result.best.sim.makespan + slack
    timed = [r for r in result.table if "makespan" in r]
    assert timed and all(result.bound <= r["makespan"] + slack for r in timed), (
        result.bound, [(r["schedule"], r["makespan"]) for r in timed])  # fmt: skip
