"""torch's CSV schedules both ways, and the V schedules as torch generates them."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from mpihybrid.analysis.metrics import analyze
from mpihybrid.cli import main
from mpihybrid.config import ConfigError, load_job
from mpihybrid.pipeline.csv_schedule import dump_csv, from_trace, parse_csv, read_csv
from mpihybrid.pipeline.plan import trace_schedule
from mpihybrid.pipeline.schedules import (
    SCHEDULES,
    ScheduleError,
    build_schedule,
    chunks_for,
    placement_of,
)
from mpihybrid.pipeline.simulate import simulate, unit_costs
from mpihybrid.trace.read import load
from tests.helpers import run_mpi

# Written the way torch.distributed.pipelining's ScheduleZBVZeroBubble(pp=2, n_microbatches=4)
# fills pipeline_order (its _calculate_single_rank_operations: rank r's row starts with r idle
# cells) and _dump_csv(format="compute_only") writes it with csv.writer ("\r\n" line ends).
TORCH_ZBV = Path(__file__).parent / "data" / "torch_zbv_pp2_m4.csv"


def test_torch_zbv_csv_is_our_zb_v():
    actions, placement, m = read_csv(str(TORCH_ZBV))
    assert m == 4 and placement == placement_of("zb-v", 2, 2)
    assert placement.stages_of(0) == [0, 3] and placement.stages_of(1) == [1, 2]
    assert actions == build_schedule("zb-v", 2, 4, 2)
    # and written back, byte for byte what torch wrote
    start = simulate(actions, placement, unit_costs(actions)).start
    assert dump_csv(actions, start) == TORCH_ZBV.read_bytes().decode()


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_round_trips_through_csv(name):
    for pp, m in ((1, 3), (2, 4), (3, 6), (4, 8)):
        v = chunks_for(name)
        actions = build_schedule(name, pp, m, v)
        placement = placement_of(name, pp, v)
        start = simulate(actions, placement, unit_costs(actions)).start
        back, back_placement, back_m = parse_csv(dump_csv(actions, start), "x.csv")
        assert (back, back_placement.stage_ranks, back_m) == (
            actions,
            placement.stage_ranks,
            m,
        )


def test_overlapped_pairs_run_first_then_second_and_torch_extras_are_skipped():
    text = "0F0,0F1,,(0F2;0B0)OVERLAP_F_B,0UNSHARD\n1F0,1I0,1W0,1F1,1B1,1F2,1B2\n"
    actions, placement, m = parse_csv(text, "t.csv")
    assert [str(a) for a in actions[0]] == ["0F0", "0F1", "0F2", "0B0"]
    assert placement.stage_ranks == (0, 1) and m == 3


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0,0X0\n", "row 1 (rank 0) cell 2: '0X0': a compute-only schedule holds F, I, W"),
        ("0F0,F0\n", "row 1 (rank 0) cell 2: 'F0' is not an action like 0F0"),
        ("0F0,0SEND_F0\n", "a compute-only schedule holds F, I, W and B actions (messages"),
        ("0F0,1F0\n1B0\n", "stage 1 is on rank 0 and on rank 1"),
        ("0F0,0I0\n", "0I0 has no 0W0"),
        ("0F0,0B0,0W0\n", "0B0 is a whole backward, yet 0W0 runs too"),
        ("", "no rows"),
    ],
)
def test_malformed_csv_names_row_and_cell(text, message):
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_csv(text, "t.csv")


def _job(tmp_path: Path, rows: str, *extra: str):
    path = tmp_path / "s.csv"
    path.write_text(rows)
    sets = [f"train.schedule=csv:{path}", "grid.pp=2", "grid.dp=1", "model.depth=4"]
    return load_job(None, [*sets, "train.global_batch=16", *extra], 2)


def test_csv_job_takes_placement_and_chunks_from_the_rows(tmp_path):
    job = _job(tmp_path, TORCH_ZBV.read_bytes().decode(), "train.microbatches=4")
    assert job.train.virtual_stages == 2  # the rows hold two stages per rank


@pytest.mark.parametrize(
    "rows, extra, message",
    [
        # rank 0 waits in 0B0 for a gradient rank 1 sends after 1F1, whose input 0F1 comes
        # after 0B0 on rank 0: a deadlock, in one line
        (
            "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n",
            "train.microbatches=2",
            "rank 0 step 1 [0B0] <-- here",
        ),
        ("0F0,0F1,0B0,0B1\n1F0,1B0\n", "train.microbatches=2", "no F for stage 1 mb 1"),
        (
            TORCH_ZBV.read_bytes().decode(),
            "train.microbatches=8",
            "schedules 4 micro-batches, not 8",
        ),
        ("0F0,0B0\n", "train.microbatches=1", "has 1 rows (pp rank each), not pp=2"),
    ],
)
def test_bad_csv_jobs_are_one_line_config_errors(tmp_path, rows, extra, message):
    with pytest.raises(ConfigError) as err:
        _job(tmp_path, rows, extra)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_schedule_show_writes_and_reads_csv(tmp_path):
    out = tmp_path / "zbv.csv"
    runner = CliRunner()
    show = ["schedule", "show", "--schedule", "zb-v", "--pp", "2", "-m", "4", "--csv", str(out)]
    result = runner.invoke(main, show)
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == TORCH_ZBV.read_bytes()
    again = runner.invoke(main, ["schedule", "show", "--schedule", f"csv:{out}", "--pp", "2",
                                 "-m", "4"])  # fmt: skip
    assert again.exit_code == 0, again.output
    assert "3F0" in again.output and "placement v: stages per rank r0:0,3 r1:1,2" in again.output
    bad = runner.invoke(main, ["schedule", "show", "--schedule", "csv:/no/such.csv"])
    assert bad.exit_code == 2 and "csv:/no/such.csv: cannot read it" in bad.output


def test_a_trace_carrying_its_csv_resolves_to_that_copy(tmp_path):
    # two runs of one path whose file changed between them, and the file gone: each trace's
    # schedule is the CSV it carries
    gpipe = dump_csv(build_schedule("gpipe", 2, 2), simulate(
        build_schedule("gpipe", 2, 2), placement_of("gpipe", 2, 1)).start)  # fmt: skip
    zbv = TORCH_ZBV.read_bytes().decode()
    name = f"csv:{tmp_path / 'gone.csv'}"
    trace = {"schedule": name, "pp": 2, "virtual_stages": 2, "early_grad_send": False}
    first = trace_schedule({**trace, "schedule_csv": zbv, "microbatches": 4})
    second = trace_schedule(
        {**trace, "schedule_csv": gpipe, "microbatches": 2, "virtual_stages": 1}
    )
    assert first.name == second.name == name and first.csv == zbv and second.csv == gpipe
    assert first.lists() == build_schedule("zb-v", 2, 4, 2)
    assert second.lists() == build_schedule("gpipe", 2, 2)
    assert from_trace({"schedule": "zb-v"}) == ("zb-v", None)
    assert from_trace({"schedule": name}) == (name, None)  # an older trace: the file, as before
    with pytest.raises(ScheduleError, match="cannot read it"):
        trace_schedule({**trace, "microbatches": 4})


@pytest.mark.mpi
def test_csv_run_is_analysed_after_its_file_is_deleted(tmp_path):
    csv_file, trace = tmp_path / "zbv.csv", tmp_path / "run.h5"
    csv_file.write_bytes(TORCH_ZBV.read_bytes())
    proc = run_mpi(2, "-m", "mpihybrid", "train", "--quiet", "--trace", str(trace),
                   "--set", f"train.schedule=csv:{csv_file}", "--set", "model.depth=8",
                   "--set", "model.hidden=16", "--set", "train.steps=2",
                   "--set", "train.microbatches=4")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    csv_file.unlink()
    run = load(trace)
    assert run.attrs["schedule"] == f"csv:{csv_file}"
    assert run.attrs["schedule_csv"] == TORCH_ZBV.read_bytes().decode()  # as it ran
    result = analyze(run)
    assert result["run"]["schedule"] == f"csv:{csv_file}"
    assert 0.0 < result["bubble"]["predicted"] < 1.0
    assert [s["predicted_peak_inflight"] for s in result["stages"]] == [4, 3, 2, 1]
    runner = CliRunner()
    for command in (["analyze", str(trace)], ["timeline", str(trace), "--ascii"],
                    ["schedule", "show", "--trace", str(trace)]):  # fmt: skip
        shown = runner.invoke(main, command)
        assert shown.exit_code == 0 and "cannot read it" not in shown.output, shown.output
    shown = runner.invoke(main, ["schedule", "show", "--trace", str(trace), "--csv",
                                 str(tmp_path / "back.csv")])  # fmt: skip
    assert (tmp_path / "back.csv").read_bytes() == TORCH_ZBV.read_bytes()
    assert "placement v: stages per rank r0:0,3 r1:1,2" in shown.output
