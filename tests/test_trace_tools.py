"""The trace commands on what a new user has: a trace.events = false trace (what it holds, what
it cannot show, no traceback), compare's column labels, steps counted from 1, unfinished runs."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from mpihybrid.cli import main
from mpihybrid.cli.trace import short_labels
from mpihybrid.trace.file import write_trace
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND

ATTRS = {"world_size": 2, "pp": 2, "dp": 1, "schedule": "1f1b", "microbatches": 4,
         "virtual_stages": 1, "codec": "fp32", "hostnames": ["a", "a"]}  # fmt: skip
CONFIG = "[train]\nglobal_batch = 32\nsteps = 3\n"


def step_rows(steps: int = 3, ranks: int = 2) -> np.ndarray:
    rows = np.zeros(steps * ranks, EVENT_DTYPE)
    rows["kind"] = KIND["step"]
    rows["rank"] = np.tile(np.arange(ranks), steps)
    rows["step"] = np.repeat(np.arange(steps), ranks)
    rows["start"] = rows["step"] * 0.010
    rows["end"] = rows["start"] + 0.008
    return rows


@pytest.fixture
def steps_only(tmp_path):
    path = tmp_path / "steps.h5"
    metrics = {"step": np.arange(3), "loss": [2.0, 1.5, 1.2], "accuracy": [0.1, 0.2, 0.3]}
    write_trace(path, events=step_rows(), steps=metrics, config=CONFIG, attrs=ATTRS)
    return path


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_analyze_says_what_a_steps_only_trace_cannot_show(steps_only):
    result = cli("analyze", steps_only)
    assert result.exit_code == 0, result.output
    assert "trace.events = false" in result.output and "no time split, bubble" in result.output
    assert "bubble measured" not in result.output  # no zeros printed as if measured
    assert "mean 8.00 ms" in result.output and "final loss 1.2000" in result.output


def test_timeline_draws_a_steps_only_trace_and_ascii_refuses_in_one_line(steps_only, tmp_path):
    out = tmp_path / "steps.png"
    result = cli("timeline", steps_only, "-o", out, "--steps", "1:2")
    assert result.exit_code == 0, result.output  # was: ValueError traceback from matplotlib
    assert out.read_bytes()[:4] == b"\x89PNG" and "steps 1-2" in result.output
    result = cli("timeline", steps_only, "--ascii")
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "trace.events = false" in lines[0]


def test_analyze_says_a_run_did_not_finish(tmp_path):
    path = tmp_path / "stopped.h5"
    write_trace(path, events=step_rows(), steps={}, config=CONFIG, attrs=ATTRS)
    import h5py

    with h5py.File(path, "a") as f:
        f.attrs["finished"], f.attrs["stopped_at_step"] = False, 3
    assert "stopped after step 3" in cli("analyze", path).output


def test_compare_labels_by_the_shortest_distinguishing_path(tmp_path):
    assert short_labels(["runs/a/trace.h5", "runs/b/trace.h5"]) == ["a/trace.h5", "b/trace.h5"]
    assert short_labels(["x/1f1b.h5", "x/zb.h5"]) == ["1f1b.h5", "zb.h5"]
    assert short_labels(["p/q/t.h5", "r/q/t.h5"]) == ["p/q/t.h5", "r/q/t.h5"]


# --- one measured window, tokens/s, oversubscription, compare --json ----------------------------


def pipeline_trace(path, steps=4, first_slow=100.0, config=CONFIG, attrs=ATTRS, scale=1.0):
    """A pp=2 trace, one micro-batch a step: rank 0 F then B, rank 1 F then B; step 1 (the
    warm-up) `first_slow` times longer, every step `scale` times longer than the reference."""
    rows = []
    for t in range(steps):
        o, k = 1000.0 * t, scale * (first_slow if t == 0 else 1.0)
        for rank, (f0, f1, b0, b1) in ((0, (0, 1, 3, 4)), (1, (1, 2, 2, 3))):
            for kind, a, b in (("forward", f0, f1), ("backward", b0, b1), ("step", 0, 4)):
                stage = -1 if kind == "step" else rank
                rows.append((rank, stage, 0, KIND[kind], t, 0 if stage >= 0 else -1,
                             o + k * a, o + k * b, 0, -1, k * (b - a)))  # fmt: skip
    events = np.array(rows, dtype=EVENT_DTYPE)
    metrics = {"step": np.arange(steps), "loss": [1.0] * steps, "accuracy": [0.5] * steps}
    write_trace(path, events=events, steps=metrics, config=config, attrs=attrs)
    return path


def test_every_figure_comes_from_one_measured_window(tmp_path):
    from mpihybrid.analysis.metrics import analyze
    from mpihybrid.trace.read import load

    result = analyze(load(pipeline_trace(tmp_path / "run.h5")))
    assert result["window"] == {"first": 2, "last": 4, "steps": 3, "traced_steps": 4,
                                "left_out": [1]}  # fmt: skip
    # the 100x warm-up step counts nowhere: rank rows, stage rows, step time, throughput
    assert result["ranks"][0]["forward"] == pytest.approx(3 * 1.0)
    assert result["ranks"][0]["total"] == pytest.approx(3 * 4.0)
    assert result["stages"][1]["backward"] == pytest.approx(3 * 1.0)
    assert result["step_time"]["mean"] == pytest.approx(4.0)
    tp = result["throughput"]
    assert tp["samples"] == 3 * 32 and tp["samples_per_s"] == pytest.approx(32 / 4.0)
    assert tp["tokens_per_s"] is None  # not token data
    out = cli("analyze", tmp_path / "run.h5").output
    assert "steps 2-4 (3 steps; step 1, warm-up, left out)" in out
    assert "8 samples/s" in out and "oversubscribed" not in out


def test_token_runs_report_tokens_per_second(tmp_path):
    config = CONFIG + '[model]\nkind = "gpt"\n[data]\nseq_len = 16\n'
    path = pipeline_trace(tmp_path / "gpt.h5", config=config)
    out = cli("analyze", path).output
    assert "128 tokens/s (8 sequences/s)" in out
    out = cli("compare", path, path).output
    assert any(line.startswith("tokens/s") and "128" in line for line in out.splitlines())


def test_oversubscription_is_shown_where_the_figures_are(tmp_path):
    crowded = pipeline_trace(tmp_path / "crowded.h5", attrs={**ATTRS, "host_cores": [1, 1]})
    roomy = pipeline_trace(tmp_path / "roomy.h5", attrs={**ATTRS, "host_cores": [2, 2]})
    caveat = "oversubscribed: 2 ranks on 1 cores of a"
    assert caveat in cli("analyze", crowded).output
    assert "oversubscribed" not in cli("analyze", roomy).output
    out = cli("compare", roomy, crowded).output
    assert f"crowded.h5: {caveat}" in out and "roomy.h5: " not in out


def test_oversubscription_hint_names_a_grid_the_cli_accepts():
    from mpihybrid.train.tracing import oversubscribed

    text = oversubscribed([("h", 2)] * 4)
    assert "mpiexec -n 2 --set grid.pp=P --set grid.dp=D" in text
    assert "grid.pp=... grid.dp=" not in text  # one key per --set: the form the CLI takes
    assert oversubscribed([("h", 4)] * 4) is None


def test_compare_json_has_each_runs_figures_and_ratios(tmp_path):
    import json

    fast = pipeline_trace(tmp_path / "fast.h5")
    slow = pipeline_trace(tmp_path / "slow.h5", scale=2.0)
    result = cli("compare", fast, slow, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    first, second = data["runs"]
    assert [first["label"], second["label"]] == ["fast.h5", "slow.h5"]
    assert second["figures"]["step_time_mean_s"] == pytest.approx(8.0)
    assert second["ratio_to_first"]["step_time_mean_s"] == pytest.approx(2.0)
    assert second["ratio_to_first"]["samples_per_s"] == pytest.approx(0.5)
    assert second["window"]["first"] == 2 and first["oversubscribed"] is None


def test_a_step_range_includes_both_ends_everywhere(steps_only):
    from mpihybrid.analysis.timeline import step_range, steps_text
    from mpihybrid.trace.read import load

    trace = load(steps_only)  # steps 1-3, as the CLI counts them
    assert step_range(trace, "1:2") == range(0, 2) and steps_text(range(0, 2)) == "steps 1-2"
    assert step_range(trace, "2:") == range(1, 3) and step_range(trace, ":1") == range(0, 1)
    assert step_range(trace, "2:2") == range(1, 2) and step_range(trace, None) == range(2, 3)
    assert step_range(trace, 3) == range(2, 3) and step_range(trace, "1:9") == range(0, 3)


def test_export_a_window_of_steps_counted_from_1(tmp_path):
    import csv
    import json

    run = pipeline_trace(tmp_path / "run.h5")  # steps 1-4, 6 rows each
    out = tmp_path / "w.csv"
    result = cli("export", run, "--format", "csv", "-o", out, "--steps", "2:3")
    assert result.exit_code == 0 and "12 events, steps 2-3" in result.output, result.output
    with open(out, newline="") as fh:
        assert {int(r["step"]) for r in csv.DictReader(fh)} == {2, 3}
    out = tmp_path / "w.json"
    assert cli("export", run, "--format", "chrome", "-o", out, "--steps", "4").exit_code == 0
    slices = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    slices = [e for e in slices if e["cat"] != "critical"]  # (the critical path's are extra)
    assert len(slices) == 6 and {e["args"]["step"] for e in slices} == {4}
    result = cli("export", run, "--format", "csv", "-o", tmp_path / "x.csv", "--steps", "7:9")
    assert result.exit_code == 2 and "the trace holds steps 1..4" in result.output


def test_export_and_timeline_refuse_to_write_over_their_input(tmp_path):
    run = pipeline_trace(tmp_path / "run.h5")
    before = run.read_bytes()
    for args in (("export", run, "--format", "csv", "-o", run, "--overwrite"),
                 ("export", run, "--format", "chrome", "-o", tmp_path / "." / "run.h5"),
                 ("timeline", run, "-o", run, "--overwrite")):  # fmt: skip
        result = cli(*args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and "is the input trace" in lines[0]
    assert run.read_bytes() == before


def png_size(path) -> tuple[int, int]:
    import struct

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_timeline_stacks_runs_on_one_time_axis(tmp_path):
    fast = pipeline_trace(tmp_path / "fast.h5")
    slow = pipeline_trace(tmp_path / "slow.h5", scale=2.0)
    out = tmp_path / "both.png"
    result = cli("timeline", fast, slow, "-o", out, "--steps", "2:3")
    assert result.exit_code == 0 and "2 runs stacked" in result.output, result.output
    assert png_size(out) == (1400, 2 * (150 + 50 * 2))  # a panel of two ranks per run
    result = cli("timeline", fast, slow)  # where would it go?
    assert result.exit_code == 2 and "give -o OUT.png" in result.output


def test_timeline_refuses_more_bars_than_it_can_draw(tmp_path, monkeypatch):
    import mpihybrid.analysis.timeline as timeline

    run = pipeline_trace(tmp_path / "run.h5")  # 4 bars a step
    monkeypatch.setattr(timeline, "MAX_BARS", 10)
    result = cli("timeline", run, "-o", tmp_path / "all.png", "--steps", "1:4")
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1
    assert "steps 1-4 hold 16 events, more than the 10 bars" in lines[0]
    assert not (tmp_path / "all.png").exists()
    assert cli("timeline", run, "-o", tmp_path / "two.png", "--steps", "1:2").exit_code == 0
