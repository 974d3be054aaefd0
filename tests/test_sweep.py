"""`mpihybrid sweep`: the grid of runs, the CSV, the plots, bad input; real mpiexec runs."""

from __future__ import annotations

import csv
import importlib.util
import math
import struct

import numpy as np
import pytest

from mpihybrid.cli.sweep import PLOTS
from mpihybrid.cli.sweep_plan import Cell, cell_job, parse_microbatches, parse_schedules, plan
from mpihybrid.cli.sweep_rows import (
    COLUMNS,
    add_speedups,
    format_table,
    peak_activation_bytes,
    write_csv,
)
from mpihybrid.config import ConfigError, build_job, resolve
from mpihybrid.pipeline.simulate import bubble_formula
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND, step_times
from tests.helpers import run_mpi

TINY_JOB = """
[grid]
pp = 2
dp = 1
[model]
hidden = 16
depth = 4
[data]
features = 8
train_samples = 512
test_samples = 32
[train]
steps = 2
global_batch = 12   # 6 rows per micro-batch at M = 2
microbatches = 2
"""
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def sweep(*args, cwd=None):
    return run_mpi(2, "-m", "mpihybrid", "sweep", *args, timeout=120, cwd=cwd)


def read_csv(path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# ---------------------------------------------------------------- pure logic


def test_parse_schedules_and_microbatches():
    assert parse_schedules("all") == [
        "naive", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev",
        "v-half",
    ]  # fmt: skip
    assert parse_schedules("zb-h1,gpipe") == ["zb-h1", "gpipe"]
    assert parse_microbatches("2,4,8") == [2, 4, 8]
    for bad in ("1f1b,pipedream", "gpipe,gpipe", ""):
        with pytest.raises(ConfigError):
            parse_schedules(bad)
    for bad in ("2,x", "2,,4", "0,2", "4,4", ""):
        with pytest.raises(ConfigError):
            parse_microbatches(bad)


def test_cells_keep_the_microbatch_size_and_skip_what_a_schedule_rejects():
    job = resolve(
        build_job(
            {"grid": {"pp": 2, "dp": 2}, "model": {"depth": 3}, "train": {"global_batch": 48}}
        ),
        4,
    )  # 48 / (dp 2 * M 4) = 6 rows per micro-batch
    assert cell_job(job, Cell("gpipe", 8, 1), 4).train.global_batch == 6 * 2 * 8
    cells, notes = plan(job, ["1f1b", "interleaved-1f1b"], [2, 3], 2, 4)
    assert [(c.schedule, c.microbatches, c.virtual_stages) for c, _ in cells] == [
        ("1f1b", 2, 1),
        ("1f1b", 3, 1),
    ]
    # M = 2: depth 3 < pp * v = 4; M = 3: 3 % pp != 0
    assert len(notes) == 2 and all(n.startswith("skipped interleaved-1f1b") for n in notes)
    assert "depth" in notes[0] and "% pp" in notes[1]


def _events(rows):
    out = np.zeros(len(rows), EVENT_DTYPE)
    for i, (rank, kind, step, stage, mb, start, end, nbytes) in enumerate(rows):
        out[i] = (rank, stage, 0, KIND[kind], step, mb, start, end, nbytes, -1, np.nan)
    return out


def test_step_times_span_all_ranks():
    events = _events(
        [
            (0, "step", 0, -1, -1, 0.0, 5.0, 0),
            (1, "step", 0, -1, -1, 0.5, 6.0, 0),
            (0, "step", 1, -1, -1, 6.0, 9.0, 0),
            (1, "step", 1, -1, -1, 6.2, 10.0, 0),
        ]
    )
    assert step_times(events) == {0: 6.0, 1: 4.0}
    assert step_times(events[events["rank"] == 1]) == pytest.approx({0: 5.5, 1: 3.8})  # its own


def test_peak_activation_bytes_frees_at_b_or_at_w_when_split():
    unsplit = _events(
        [
            (0, "forward", 0, 0, 0, 0, 1, 100),
            (0, "forward", 0, 0, 1, 1, 2, 100),
            (0, "backward", 0, 0, 0, 2, 3, 0),
            (0, "forward", 0, 0, 2, 3, 4, 100),
        ]
    )
    assert peak_activation_bytes(unsplit, 0) == 200
    split = _events(
        [
            (0, "forward", 0, 0, 0, 0, 1, 100),
            (0, "backward", 0, 0, 0, 1, 2, 0),
            (0, "forward", 0, 0, 1, 2, 3, 100),  # mb 0 still alive: its W has not run
            (0, "weight", 0, 0, 0, 3, 4, 0),
            (1, "forward", 0, 1, 0, 0, 1, 50),
        ]
    )
    assert peak_activation_bytes(split, 0) == 200


def test_speedup_is_against_gpipe_median_at_the_same_m(tmp_path):
    rows = [
        {"schedule": "gpipe", "microbatches": 4, "step_ms": 10.0},
        {"schedule": "gpipe", "microbatches": 4, "step_ms": 30.0},
        {"schedule": "gpipe", "microbatches": 4, "step_ms": 12.0},
        {"schedule": "1f1b", "microbatches": 4, "step_ms": 8.0},
        {"schedule": "1f1b", "microbatches": 2, "step_ms": 8.0},
    ]
    add_speedups(rows)
    assert [r.get("speedup_vs_gpipe") for r in rows] == [1.2, 0.4, 1.0, 1.5, None]


def test_table_shows_medians_over_repeats_and_survives_a_zero_prediction():
    def row(schedule, repeat, step_ms, predicted):
        return {
            "schedule": schedule, "virtual_stages": 1, "microbatches": 4, "repeat": repeat,
            "step_ms": step_ms, "samples_per_s": 400 / step_ms, "bubble_measured": 0.01,
            "bubble_predicted": predicted, "bubble_textbook": 0.0, "peak_inflight": 4,
            "peak_inflight_predicted": 4, "peak_activation_mib": 1.0,
        }  # fmt: skip

    rows = [row("gpipe", i, t, 0.0) for i, t in enumerate((10.0, 30.0, 12.0))]
    rows.append(row("1f1b", 0, 8.0, 0.02))
    add_speedups(rows)
    lines = format_table(rows).splitlines()
    assert lines[2].split() == "4 gpipe 12.0 33 0.010 0.000 0.000 - 4 4 1.0 1.00x".split()
    assert lines[3].split() == "4 1f1b 8.0 50 0.010 0.020 0.000 -50% 4 4 1.0 1.50x".split()


def test_write_csv_refuses_an_existing_file(tmp_path):
    path = tmp_path / "out.csv"
    path.write_text("precious")
    with pytest.raises(ConfigError, match="--overwrite"):
        write_csv(path, [])
    assert path.read_text() == "precious"
    write_csv(path, [], overwrite=True)
    assert path.read_text().strip() == ",".join(COLUMNS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]  # no temporary left


# ---------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    job = tmp / "tiny.toml"
    job.write_text(TINY_JOB)
    out = tmp / "sweep.csv"
    args = [str(job), "--schedules", "gpipe,1f1b", "--microbatches", "2,4", "--repeats", "1"]
    args += ["-o", str(out)] + (["--plots", str(tmp / "plots")] if HAS_MATPLOTLIB else [])
    proc = sweep(*args)
    return proc, out, tmp / "plots"


@pytest.mark.mpi
def test_tiny_sweep_writes_one_sane_row_per_run(tiny_sweep):
    proc, out, _ = tiny_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(out)
    assert list(rows[0]) == list(COLUMNS)
    cells = sorted((r["schedule"], int(r["microbatches"])) for r in rows)
    assert cells == [("1f1b", 2), ("1f1b", 4), ("gpipe", 2), ("gpipe", 4)]
    for r in rows:
        name, m = r["schedule"], int(r["microbatches"])
        assert int(r["global_batch"]) == 6 * m and int(r["microbatch_size"]) == 6
        assert int(r["measured_steps"]) == 1 and int(r["repeat"]) == 0
        assert float(r["step_ms"]) > 0 and float(r["samples_per_s"]) > 0
        assert math.isclose(
            float(r["samples_per_s"]), 6 * m / (float(r["step_ms"]) / 1e3), rel_tol=1e-4
        )
        for key in ("bubble_measured", "bubble_predicted"):
            assert 0.0 <= float(r[key]) < 1.0, (key, r[key])
        assert math.isclose(float(r["bubble_textbook"]), bubble_formula(name, 2, m), rel_tol=1e-5)
        # GPipe keeps every micro-batch alive on both stages; 1F1B at most pp - stage of them
        expected = f"{m};{m}" if name == "gpipe" else "2;1"
        assert r["peak_inflight_per_stage"] == r["peak_inflight_predicted_per_stage"] == expected
        assert float(r["peak_activation_mib"]) > 0
        assert float(r["forward_ms"]) > 0 and float(r["backward_ms"]) > 0
        assert float(r["weight_ms"]) > 0.0  # the last stage sends its gradient before W
        assert math.isfinite(float(r["final_loss"]))
        gpipe = next(g for g in rows if g["schedule"] == "gpipe" and g["microbatches"] == str(m))
        speedup = float(gpipe["step_ms"]) / float(r["step_ms"])
        assert math.isclose(float(r["speedup_vs_gpipe"]), speedup, rel_tol=1e-4)
    assert "plan: 4 cells (gpipe, 1f1b x M 2,4) x 1 repeat = 4 runs of" in proc.stdout
    # the table printed by rank 0: one line per (M, schedule)
    assert sum(line.split()[:2] in (["2", "gpipe"], ["4", "1f1b"]) for line in
               proc.stdout.splitlines()) == 2  # fmt: skip


@pytest.mark.mpi
@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="needs the plot extra (matplotlib)")
def test_tiny_sweep_draws_real_pngs(tiny_sweep):
    proc, _, plots = tiny_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in PLOTS:
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", name
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 300 and height >= 200, (name, width, height)
        assert len(data) > 5000, name  # axes, lines and labels, not a blank canvas


@pytest.mark.mpi
def test_skipped_combination_is_noted_and_overwrite_replaces(tmp_path):
    job = tmp_path / "tiny.toml"
    job.write_text(TINY_JOB)
    out = tmp_path / "sweep.csv"
    out.write_text("old")
    proc = sweep(str(job), "--schedules", "interleaved-1f1b,zb-h1", "--microbatches", "3",
                 "--repeats", "2", "-o", str(out), "--overwrite")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: skipped interleaved-1f1b M=3" in proc.stdout
    rows = read_csv(out)
    assert [(r["schedule"], r["repeat"]) for r in rows] == [("zb-h1", "0"), ("zb-h1", "1")]
    assert all(r["speedup_vs_gpipe"] == "" for r in rows)  # no GPipe run to compare with
    assert float(rows[0]["weight_ms"]) > 0  # zb-h1 splits the backward into B and W


@pytest.mark.mpi
@pytest.mark.parametrize(
    "args, message",
    [
        (["--schedules", "1f1b,pipedream"], "unknown schedule 'pipedream'"),
        (["--microbatches", "2,x"], "--microbatches '2,x'"),
        (["--microbatches", "0,2"], "integers >= 1"),
        (["--repeats", "0"], "--repeats = 0"),
        (["--warmup-steps", "2"], "must exceed --warmup-steps(2)"),
        (["--set", "train.global_batch=13"], "not divisible"),
        (["-o", "/nonexistent-dir/x.csv"], "/nonexistent-dir"),
        (["--plots", "/dev/null/plots"], "--plots /dev/null/plots: cannot create"),
        (["--repeats", "2000000000"], "x 2000000000 = "),  # schedules x M x repeats = runs
    ],
)
def test_bad_input_exits_2_on_every_rank_before_training(tmp_path, args, message):
    job = tmp_path / "tiny.toml"
    job.write_text(TINY_JOB)
    out = ["-o", str(tmp_path / "out.csv")] if "-o" not in args else []
    proc = sweep(str(job), *out, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mpihybrid: error:"), proc.stderr
    assert message in lines[0], lines[0]
    assert proc.stdout == "" and not (tmp_path / "out.csv").exists()


@pytest.mark.mpi
def test_existing_output_is_refused(tmp_path):
    job = tmp_path / "tiny.toml"
    job.write_text(TINY_JOB)
    out = tmp_path / "sweep.csv"
    out.write_text("precious")
    proc = sweep(str(job), "--schedules", "1f1b", "--microbatches", "2", "-o", str(out))
    assert proc.returncode == 2 and "--overwrite" in proc.stderr, proc.stderr
    assert out.read_text() == "precious"


def test_fixed_global_batch_keeps_the_batch_and_skips_what_does_not_divide():
    job = resolve(build_job({"grid": {"pp": 2, "dp": 1}, "train": {"global_batch": 12}}), 2)
    cells, notes = plan(job, ["1f1b"], [2, 4, 5], 2, 2, fixed_batch=True)
    assert [(c.microbatches, j.train.global_batch) for c, j in cells] == [(2, 12), (4, 12)]
    assert len(notes) == 1 and "M=5" in notes[0] and "not divisible" in notes[0]


def test_medians_carry_the_spread_over_repeats():
    from mpihybrid.cli.sweep_rows import medians

    rows = []
    for repeat, (ms, bubble) in enumerate([(10.0, 0.2), (14.0, 0.3), (11.0, 0.25)]):
        rows.append({"schedule": "1f1b", "virtual_stages": 1, "microbatches": 4, "repeat": repeat,
                     "step_ms": ms, "samples_per_s": 100 / ms, "bubble_measured": bubble,
                     "bubble_predicted": 0.2, "peak_inflight": 2, "peak_activation_mib": 1.0,
                     "speedup_vs_gpipe": None})  # fmt: skip
    (row,) = medians(rows)
    assert row["bubble_measured"] == 0.25 and row["bubble_measured_range"] == (0.2, 0.3)
    assert row["samples_per_s_range"] == (100 / 14, 10.0)
    assert row["speedup_vs_gpipe_range"] is None


@pytest.mark.mpi
def test_traces_per_cell_and_a_fixed_global_batch(tmp_path):
    job = tmp_path / "tiny.toml"
    job.write_text(TINY_JOB)
    out, traces = tmp_path / "sweep.csv", tmp_path / "traces"
    proc = sweep(str(job), "--schedules", "1f1b", "--microbatches", "2,3", "--repeats", "1",
                 "--fixed-global-batch", "--traces", str(traces), "-o", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(out)
    assert [(r["microbatches"], r["global_batch"]) for r in rows] == [("2", "12"), ("3", "12")]
    assert [r["microbatch_size"] for r in rows] == ["6", "4"]
    from mpihybrid.trace.read import load

    for m in (2, 3):
        trace = load(traces / f"1f1b-M{m}" / "repeat-1.h5")
        assert trace.attrs["microbatches"] == m and trace.attrs["finished"] is True
        assert len(trace.events) > 0
    # progress lines go to rank 0's stderr (a batch log shows how far it got), results to stdout
    assert "[1/2]" not in proc.stdout and "[1/2] 1f1b M=2 repeat 1" in proc.stderr
    again = sweep(str(job), "--schedules", "1f1b", "--microbatches", "2", "--repeats", "1",
                  "--traces", str(traces), "-o", str(tmp_path / "b.csv"))  # fmt: skip
    assert again.returncode == 2 and "repeat-1.h5 already exists" in again.stderr


def test_a_sweep_too_big_to_run_is_refused_before_any_cell_is_built():
    from mpihybrid.cli.sweep_plan import check_size

    check_size(5, 3, 3, 30)  # the README's sweep
    with pytest.raises(ConfigError, match=r"5 x 400,000,000 x 1|= 2,000,000,000 runs"):
        check_size(5, 400_000_000, 1, 30)
    with pytest.raises(ConfigError, match=r"train.steps\(1,000,000\)"):
        check_size(1, 2, 1, 1_000_000)


def test_token_jobs_show_tokens_per_second():
    def row(repeat, step_ms):
        return {
            "schedule": "1f1b", "virtual_stages": 1, "microbatches": 4, "repeat": repeat,
            "step_ms": step_ms, "samples_per_s": 8000 / step_ms,
            "tokens_per_s": 64 * 8000 / step_ms, "bubble_measured": 0.1,
            "bubble_predicted": 0.1, "bubble_textbook": 0.2, "peak_inflight": 2,
            "peak_inflight_predicted": 2, "peak_activation_mib": 1.0, "speedup_vs_gpipe": None,
        }  # fmt: skip

    rows = [row(0, 100.0), row(1, 200.0), row(2, 50.0)]
    add_speedups(rows)
    lines = format_table(rows).splitlines()
    assert "tokens/s" in lines[0] and "samples/s" not in lines[0]
    assert lines[2].split()[3] == "5,120"  # the median repeat: 64 tokens x 80 sequences/s
