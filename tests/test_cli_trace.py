"""The trace commands end to end: analyze, timeline, export, compare; and every bad input."""

from __future__ import annotations

import csv
import json
import shutil
import struct
import subprocess
import sys

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from mpihybrid.analysis.messages import match_messages
from mpihybrid.analysis.metrics import analyze
from mpihybrid.cli import main
from mpihybrid.trace.file import write_trace
from mpihybrid.trace.read import WRITER_ATTRS, load
from mpihybrid.trace.recorder import KIND
from tests.helpers import ROOT, run_mpi

PP, DP, M, V, STEPS = 2, 2, 4, 2, 3  # interleaved: one stage sends both ways to the same peer


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mpihybrid", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd or ROOT, timeout=60)


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """The same command run in this process (click's runner): no interpreter start-up."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def failed(proc: subprocess.CompletedProcess, needle: str = "") -> bool:
    """Exit 2 with exactly one line, `mpihybrid: error: ...`, and no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return (
        proc.returncode == 2
        and len(lines) == 1
        and lines[0].startswith("mpihybrid: error:")
        and needle in lines[0]
        and "Traceback" not in proc.stdout + proc.stderr
    )


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    """One real run of `mpihybrid train` (interleaved 1F1B, pp=2 x dp=2, v=2, 3 steps)."""
    path = tmp_path_factory.mktemp("cli") / "run.h5"
    proc = run_mpi(
        PP * DP,
        *("-m", "mpihybrid", "train", "--quiet", "--trace", str(path)),
        *("--set", f"grid.pp={PP}", "--set", "train.schedule=interleaved-1f1b"),
        *("--set", f"train.virtual_stages={V}", "--set", f"train.microbatches={M}"),
        *("--set", f"train.steps={STEPS}"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


@pytest.fixture
def bad_inputs(tmp_path, trace_path):
    """Every kind of file `load` refuses, by name."""
    text = tmp_path / "notes.h5"
    text.write_text("not an HDF5 file\n")
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(trace_path.read_bytes()[: trace_path.stat().st_size // 2])
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["data"] = np.arange(4)
    crashed = tmp_path / "crashed.h5"
    shutil.copy(trace_path, crashed)
    with h5py.File(crashed, "a") as f:
        f.attrs["complete"] = False  # what a writer killed half-way leaves
    return {
        "missing": (tmp_path / "absent.h5", "no trace file"),
        "directory": (tmp_path, "directory"),
        "not hdf5": (text, "not an HDF5 file"),
        "truncated": (truncated, "truncated"),
        "foreign": (foreign, "not an mpihybrid trace"),
        "crashed": (crashed, "incomplete run"),
    }


# --- analyze -------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_analyze_prints_tables_and_json(trace_path):
    proc = cli("analyze", trace_path)
    assert proc.returncode == 0, proc.stderr
    for needle in ("interleaved-1f1b, v=2", "bubble", "time by rank", "all-reduce per stage"):
        assert needle in proc.stdout
    lines = proc.stdout.splitlines()
    rank_header = lines[lines.index(next(x for x in lines if x.startswith("rank  stage")))]
    # every time column names its unit; the legend says what p2p wait and idle count
    for column in ("F ms", "p2p wait ms", "idle ms", "step ms", "all-reduce ms"):
        assert column in rank_header
    assert "p2p wait = blocked in a receive" in proc.stdout
    assert "idle = what no event" in proc.stdout
    assert "steps 2-3" in proc.stdout  # steps counted from 1: step 1 is the warm-up left out
    proc = cli("analyze", trace_path, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    expected = analyze(load(trace_path))
    assert result["bytes"] == expected["bytes"] and result["counts"] == expected["counts"]
    assert result["bubble"]["measured"] == pytest.approx(expected["bubble"]["measured"])
    # one F per (stage, micro-batch) per replica and step
    assert result["counts"]["forward"] == STEPS * DP * PP * V * M


# --- timeline ------------------------------------------------------------------------------------


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.mpi
def test_timeline_png_has_the_expected_size(trace_path, tmp_path):
    out = tmp_path / "last.png"
    proc = cli("timeline", trace_path, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert f"step {STEPS})" in proc.stdout  # the last step by default, counted from 1
    assert png_size(out) == (1400, 150 + 50 * PP * DP)  # WIDTH_PX, HEADER_PX + ROW_PX per rank
    first = tmp_path / "first.png"
    assert cli("timeline", trace_path, "-o", first, "--steps", "1:3").returncode == 0
    assert png_size(first) == png_size(out) and first.read_bytes() != out.read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary, nothing left over


@pytest.mark.mpi
def test_timeline_default_output_and_bad_steps(trace_path, tmp_path):
    run = tmp_path / "copy.h5"
    shutil.copy(trace_path, run)
    assert cli("timeline", run, "--step", "1").returncode == 0
    assert png_size(tmp_path / "copy.png")[0] == 1400
    assert failed(cli("timeline", run, "--step", "1"), "already exists")
    assert failed(cli("timeline", run, "--step", str(STEPS + 1)), f"steps 1..{STEPS}")
    assert failed(cli("timeline", run, "--steps", "x:y"), "expected N or A:B")


@pytest.mark.mpi
def test_timeline_ascii_is_the_grid_of_what_ran(trace_path):
    proc = cli("timeline", trace_path, "--ascii", "--step", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("step 1, replica 0") and "rank 0" in lines[1]
    cells = " ".join(lines[2:]).split()
    any_w = any("W" in c for c in cells)  # then a whole backward takes two cells (B + W)
    for s in range(PP * V):
        for mb in range(M):
            split = cells.count(f"{s}W{mb}") == 1
            assert cells.count(f"{s}F{mb}") == 1
            whole = cells.count(f"{s}BW{mb}")  # B and W in one action: BW, then ~
            assert cells.count(f"{s}B{mb}") + whole == 1
            assert whole == (1 if any_w and not split else 0)
    assert cells.count("~") == sum(c[1:3] == "BW" for c in cells)
    # gradients leave before W: every stage but the first splits its backward
    assert any_w and all(f"{s}W0" in cells for s in range(1, PP * V))


@pytest.mark.mpi
def test_timeline_without_matplotlib_says_how_to_get_it(trace_path, tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from mpihybrid.cli import main\n"
        f"main(['timeline', {str(trace_path)!r}, '-o', {str(tmp_path / 'x.png')!r}])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert failed(proc, "pip install 'mpihybrid[plot]'")
    assert not (tmp_path / "x.png").exists()


# --- export --------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_export_chrome_is_valid_trace_event_json(trace_path, tmp_path):
    out = tmp_path / "run.json"
    assert cli("export", trace_path, "--format", "chrome", "-o", out).returncode == 0
    doc = json.loads(out.read_text())
    events = load(trace_path).events
    # a slice per event, besides the critical path's own (cat "critical", tests/test_why_runs)
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] != "critical"]
    assert len(complete) == len(events)
    for e in complete:
        assert {"ph", "ts", "dur", "pid", "tid", "name", "cat", "args"} <= set(e)
        assert e["dur"] >= 0
        assert {e["pid"] for e in complete} == set(range(PP * DP))
    # steps from 1, as the progress line and every other command count them
    assert {e["name"] for e in complete if e["cat"] == "step"} == {
        f"step {s}" for s in range(1, STEPS + 1)
    }
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names) == list(range(PP * DP))
    computes = [e for e in complete if e["cat"] == "forward"]
    assert {e["name"] for e in computes} == {f"{s}F{mb}" for s in range(PP * V) for mb in range(M)}
    assert sum(e["dur"] for e in complete) == pytest.approx(
        1e6 * float((events["end"] - events["start"]).sum())
    )
    # complete events on one thread must nest: here they follow one another
    for pid in range(PP * DP):
        work = sorted((e["ts"], e["dur"]) for e in complete if e["pid"] == pid and e["tid"] == 0)
        assert all(t + d <= work[i + 1][0] + 1e-6 for i, (t, d) in enumerate(work[:-1]))
    # one flow per message, from the sender's process to the receiver's
    p2p = [e for e in doc["traceEvents"] if e.get("cat") == "p2p"]
    starts = {e["id"]: e for e in p2p if e["ph"] == "s"}
    ends = {e["id"]: e for e in p2p if e["ph"] == "f"}
    sends = int(np.sum((events["kind"] == KIND["send"]) & (events["microbatch"] >= 0)))
    assert len(starts) == len(ends) == sends > 0 and starts.keys() == ends.keys()
    slices = {(e["pid"], e["tid"], e["ts"], e["dur"], e["cat"]) for e in complete}

    def inside(flow: dict, cat: str) -> bool:
        return any(
            p == flow["pid"] and t == flow["tid"] and ts <= flow["ts"] <= ts + d and c == cat
            for p, t, ts, d, c in slices
        )

    for k in ends:
        assert starts[k]["pid"] != ends[k]["pid"]
        assert inside(starts[k], "send") and inside(ends[k], "recv")
        # an arrow runs from the posted send to where the receive completed: the end of its slice
        assert any(
            p == ends[k]["pid"] and c == "recv" and 0 <= ts + d - ends[k]["ts"] <= 1e-3 + 1e-9
            for p, t, ts, d, c in slices
        )
        assert any(
            p == starts[k]["pid"] and c == "send" and 0 <= starts[k]["ts"] - ts <= 1e-3 + 1e-9
            for p, t, ts, d, c in slices
        )
    # so no arrow runs backwards unless the ranks' clocks disagree by more than the message
    # took (midpoints, as before, put 90 of 240 backwards on a quiet machine)
    messages = match_messages(events)
    mid = (events["start"] + events["end"]) / 2
    backwards_before = int(np.sum(mid[messages.recv] < mid[messages.send]))
    backwards_now = sum(ends[k]["ts"] < starts[k]["ts"] for k in ends)
    assert backwards_now <= backwards_before
    assert backwards_now <= len(ends) // 4, (backwards_now, len(ends))


@pytest.mark.mpi
def test_export_csv_has_a_row_per_event(trace_path, tmp_path):
    out = tmp_path / "run.csv"
    assert cli("export", trace_path, "--format", "csv", "-o", out).returncode == 0
    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    events = load(trace_path).events
    assert len(rows) == len(events)
    assert {"rank", "kind", "step", "microbatch", "start", "duration", "bytes", "peer"} <= set(
        rows[0]
    )
    assert sum(int(r["bytes"]) for r in rows) == int(events["bytes"].sum())
    # every stage but the first sends its gradient before its weight gradient: a W each
    assert sum(r["kind"] == "weight" for r in rows) == (PP * V - 1) * M * STEPS * DP
    assert rows[0]["kind"] in KIND
    assert {int(r["step"]) for r in rows} == set(range(1, STEPS + 1))  # from 1, as the CLI counts


@pytest.mark.mpi
def test_export_refuses_to_overwrite(trace_path, tmp_path):
    out = tmp_path / "run.json"
    out.write_text("keep me")
    assert failed(cli("export", trace_path, "--format", "chrome", "-o", out), "already exists")
    assert out.read_text() == "keep me"
    assert cli("export", trace_path, "--format", "chrome", "-o", out, "--overwrite").returncode == 0
    assert json.loads(out.read_text())["traceEvents"]
    assert failed(cli("export", trace_path, "--format", "csv", "-o", tmp_path / "no/x.csv"))


# --- compare -------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_compare_shows_differences_and_ratios(trace_path, tmp_path):
    # a second run that differs in one setting and took exactly twice as long
    trace = load(trace_path)
    slow = trace.events.copy()
    slow["start"] *= 2
    slow["end"] *= 2
    other = tmp_path / "slow.h5"
    attrs = {k: v for k, v in trace.attrs.items() if k not in WRITER_ATTRS}
    config = trace.config.replace('codec = "fp32"', 'codec = "int8"')
    write_trace(other, events=slow, steps=trace.steps, config=config, attrs=attrs)
    proc = cli("compare", trace_path, other)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "run.h5" in lines[0] and "slow.h5" in lines[0]
    differs = [line for line in lines if line.startswith("comm.codec")]
    assert len(differs) == 1 and "fp32" in differs[0] and "int8" in differs[0]
    assert not any(line.startswith("trace.path") for line in lines)
    step = next(line for line in lines if line.startswith("step time (mean)"))
    assert "(1.00x)" in step and "(2.00x)" in step
    throughput = next(line for line in lines if line.startswith("samples/s"))
    assert "(0.50x)" in throughput
    assert failed(cli("compare", trace_path), "at least two")


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(
    "case", ["missing", "directory", "not hdf5", "truncated", "foreign", "crashed"]
)
@pytest.mark.parametrize("command", ["analyze", "timeline", "export", "compare"])
def test_bad_trace_is_one_error_line(bad_inputs, trace_path, tmp_path, case, command):
    path, needle = bad_inputs[case]
    out = tmp_path / "out.file"
    args = {
        "analyze": [path],
        "timeline": [path, "-o", out],
        "export": [path, "--format", "chrome", "-o", out],
        "compare": [trace_path, path],
    }[command]
    proc = cli_here(command, *args)
    assert failed(proc, needle), (proc.returncode, proc.stderr)
    assert not out.exists()


@pytest.mark.parametrize("command", ["analyze", "timeline", "export", "compare"])
def test_help(command):
    proc = cli_here(command, "--help")
    assert proc.returncode == 0 and ("RUN.h5" in proc.stdout or "A.h5" in proc.stdout)
