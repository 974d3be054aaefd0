"""analyze's why, whatif, compare and the pictures on a real run with a straggler made on
purpose (train.slowdown), and every bad input of whatif: one line, exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpihybrid.analysis.messages import match_messages
from mpihybrid.analysis.restage import BlockLayout
from mpihybrid.nn.model import layer_counts
from mpihybrid.trace.file import write_trace
from mpihybrid.trace.read import WRITER_ATTRS, load
from tests.helpers import run_mpi
from tests.test_cli_trace import cli_here, failed

# rank 3 (stage 1 of replica 1) runs each forward six times as long: far past what waiting for
# a core does to a rank of a healthy run on an oversubscribed machine (up to 3x, docs/analysis.md)
SLOW = "3:F:6"


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    """pp = 2 x dp = 2, 8 steps of a small MLP, rank 3's forwards slowed 6x; the run's live
    straggler line names it."""
    path = tmp_path_factory.mktemp("why") / "slow.h5"
    proc = run_mpi(
        4,
        *("-m", "mpihybrid", "train", "--quiet", "--trace", str(path)),
        *("--set", "grid.pp=2", "--set", "grid.dp=2", "--set", "model.hidden=128"),
        *("--set", "model.depth=4", "--set", "train.global_batch=128"),
        *("--set", "train.steps=8", "--set", f"train.slowdown={SLOW}"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the live line, from the step lines' boundaries (quiet hides the step lines, not it)
    assert "straggler: rank 3 (stage 1) F" in proc.stdout, proc.stdout[-2000:]
    return path


@pytest.mark.mpi
def test_analyze_names_the_slowed_rank_and_attributes_all_idle(slowed):
    proc = cli_here("analyze", slowed, "--json")
    assert proc.returncode == 0, proc.stderr
    why = json.loads(proc.stdout)["why"]
    named = [(s["rank"], s["stage"], s["kind"]) for s in why["stragglers"]["named"]]
    # the slowed one first (the highest score); others may be named too when ranks share a core
    assert named[0] == (3, 1, "F")
    assert why["stragglers"]["named"][0]["cost"]["costs"] > 0
    for row in why["idle"]["ranks"]:
        assert row["attributed"] == pytest.approx(row["idle"], rel=0.02)
    assert len(why["critical"]["paths"]) == 7  # the measured steps: 2 to 8
    assert sum(why["critical"]["shares"].values()) == pytest.approx(1.0)
    text = cli_here("analyze", slowed).stdout
    assert "straggler       rank 3 F of stage 1" in text and "critical path" in text


@pytest.mark.mpi
def test_a_rank_on_a_slower_device_is_reported_as_one_not_named(tmp_path):
    """pp = 1 x dp = 2, rank 1 on a 3x slower device (train.slowdown = 1:D:3: its every action
    and its core probe): analyze reports the device with what it costs, names no straggler in
    the work, and the live run logs no straggler line; the probe's figures are in the trace.
    Actions of a millisecond or more (128 rows of 256): a context switch's cold caches, which
    a loaded machine adds to a short action's CPU time, stay a small part of them."""
    path = tmp_path / "device.h5"
    proc = run_mpi(
        2,
        *("-m", "mpihybrid", "train", "--quiet", "--trace", str(path)),
        *("--set", "grid.pp=1", "--set", "grid.dp=2", "--set", "model.hidden=256"),
        *("--set", "model.depth=4", "--set", "train.global_batch=1024"),
        *("--set", "train.steps=8", "--set", "train.slowdown=1:D:3"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "straggler:" not in proc.stdout, proc.stdout[-2000:]
    probe = load(path).attrs["core_probe_s"]
    assert probe[1] > 2 * probe[0], probe
    found = json.loads(cli_here("analyze", path, "--json").stdout)["why"]["stragglers"]
    assert found["named"] == [], found["named"]
    (device,) = found["devices"]
    assert device["rank"] == 1 and device["core"] > 2 and device["cost"]["costs"] > 0
    assert set(device["kinds"]) == {"F", "B"}, device
    text = cli_here("analyze", path).stdout
    assert "a slower device, not its work" in text and "straggler       none" in text, text


@pytest.mark.mpi
def test_whatif_and_its_bad_input(slowed, tmp_path):
    proc = cli_here("whatif", slowed, "--set", "schedule=gpipe", "--scale", "rank3.F=0.33")
    assert proc.returncode == 0, proc.stderr
    assert "gain ceiling" in proc.stdout and "predicted" in proc.stdout
    doc = json.loads(cli_here("whatif", slowed, "--scale", "rank3.F=0.33", "--json").stdout)
    assert doc["predicted"]["phase"] < doc["replayed"]["phase"]
    # the trace's own split carried through the blocks gives the run back; a V runs on them
    layout = BlockLayout.of(load(slowed).config, 2)
    own = ",".join(map(str, layer_counts(layout.model, layout.ranges)))
    doc = json.loads(cli_here("whatif", slowed, "--set", f"partition={own}", "--json").stdout)
    assert doc["predicted"]["phase"] == pytest.approx(doc["replayed"]["phase"], rel=1e-9)
    doc = json.loads(cli_here("whatif", slowed, "--set", "schedule=zb-v", "--json").stdout)
    assert doc["predicted"]["phase"] > 0 and doc["change"] == "schedule=zb-v"
    # messages that hold their link: each step's hold is the one under which the run replays
    # as without a link; a link 2000x slower queues them, one wire more than two
    # (where no message found its receiver waiting, the hop reads 0 and whatif says there is
    # nothing to scale: 1 run in 10 with 4 ranks and a CPU hog on 2 cores)
    slow = ("--scale", "hop=2000", "--json")
    plain = json.loads(cli_here("whatif", slowed, *slow).stdout)
    for link in ("duplex", "shared"):
        doc = json.loads(cli_here("whatif", slowed, "--set", f"link={link}", *slow).stdout)
        # (within the jump the queue makes where the hold's bisection ends: up to 1.3 % seen)
        assert doc["replayed"]["phase"] == pytest.approx(plain["replayed"]["phase"], rel=0.03)
        if doc["hop"] > 0:
            assert doc["predicted"]["phase"] > plain["predicted"]["phase"] and not doc["notes"]
        else:
            assert doc["predicted"]["phase"] == plain["predicted"]["phase"]
            assert "hop reads 0" in doc["notes"][0], doc["notes"]
        assert doc["change"] == f"link={link}, hopx2000"
        plain = doc
    for args, needle in (
        (("--scale", "F=-1"), "factor"),
        (("--scale", "F=nan"), "factor"),
        (("--scale", "stage7=2"), "2 stages"),
        (("--scale", "disk=2"), "WHAT"),
        (("--set", "colour=red"), "keys"),
        (("--set", "M=0"), "M must"),
        (("--set", "partition=9,9"), "layers"),
        (("--set", "partition=1,1,2"), "3 counts for 2 stages"),
        (("--set", "schedule=interleaved-1f1b"), "virtual_stages"),
        (("--set", "schedule=nope"), "nope"),
        (("--set", "link=fast"), "duplex"),
    ):
        assert failed(cli_here("whatif", slowed, *args), needle), args
    assert failed(cli_here("whatif", tmp_path / "none.h5"), "no trace")
    trace = load(slowed)
    attrs = {k: v for k, v in trace.attrs.items() if k not in WRITER_ATTRS}
    for name, events, needle, said in (
        ("one_rank.h5", trace.events[trace.events["rank"] == 0], "of 4 ranks", "of 4 ranks"),
        ("empty.h5", trace.events[:0], "per-action", "no events"),
    ):
        write_trace(tmp_path / name, events=events, steps=trace.steps, config=trace.config,
                    attrs=attrs)  # fmt: skip
        assert failed(cli_here("whatif", tmp_path / name), needle), name
        assert failed(cli_here("analyze", tmp_path / name), said), name
    # every receive posted after its send began: no hop measured, and whatif says so
    events = trace.events.copy()
    pairs = match_messages(events)
    late = np.maximum(events["start"][pairs.recv], events["start"][pairs.send] + 1e-9)
    events["start"][pairs.recv] = late
    events["end"][pairs.recv] = np.maximum(events["end"][pairs.recv], late)
    write_trace(tmp_path / "nohop.h5", events=events, steps=trace.steps, config=trace.config,
                attrs=attrs)  # fmt: skip
    doc = json.loads(cli_here("whatif", tmp_path / "nohop.h5", *slow).stdout)
    assert doc["hop"] == 0 and "hop reads 0" in doc["notes"][0], doc
    assert doc["predicted"]["phase"] == pytest.approx(doc["replayed"]["phase"], rel=1e-9)
    text = cli_here("whatif", tmp_path / "nohop.h5", "--scale", "hop=3").stdout
    assert "note            the trace's hop reads 0" in text, text
    assert not json.loads(cli_here("whatif", tmp_path / "nohop.h5", "--json").stdout)["notes"]
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("*.json"))


@pytest.mark.mpi
def test_a_change_of_m_is_costed_by_the_traces_own_row_probe(slowed, tmp_path):
    """The run timed each chunk's passes at its rows and at half (train/row_probe.py); whatif's
    change of M takes the line through them, a trace without them the cost model, and a
    malformed probe is one line."""
    from mpihybrid.analysis.replay import Change, Measured
    from mpihybrid.predict.rows import costed, probed_factors, row_factors

    trace = load(slowed)
    base = Measured.of(trace, str(slowed))
    rows, seconds = base.row_probe
    assert rows[1] == rows[0] // 2 and len(seconds) == 12 and min(seconds) > 0
    assert sum(seconds[0::2]) > sum(seconds[1::2]), seconds  # half the rows cost less
    change = costed(base, Change(microbatches=2 * base.m))
    assert change.rows == probed_factors(base.row_probe, base.m, 2 * base.m, 2)
    attrs = {k: v for k, v in trace.attrs.items() if k not in WRITER_ATTRS}
    plain = {k: v for k, v in attrs.items() if not k.startswith("row_probe")}
    write_trace(tmp_path / "plain.h5", events=trace.events, steps=trace.steps,
                config=trace.config, attrs=plain)  # fmt: skip
    old = Measured.of(load(tmp_path / "plain.h5"), "plain")
    assert old.row_probe is None
    want = row_factors(trace.config, base.m, 2 * base.m, 2)
    assert costed(old, Change(microbatches=2 * base.m)).rows == want
    write_trace(tmp_path / "bad.h5", events=trace.events, steps=trace.steps,
                config=trace.config, attrs=attrs | {"row_probe_s": [1.0]})  # fmt: skip
    assert failed(cli_here("whatif", tmp_path / "bad.h5"), "row_probe")


@pytest.mark.mpi
def test_compare_attributes_and_pictures_draw_the_path(slowed, tmp_path):
    proc = cli_here("compare", slowed, slowed, "--json")
    assert proc.returncode == 0, proc.stderr
    att = json.loads(proc.stdout)["actions"]["attribution"]
    assert att["measured"] == pytest.approx(0.0) and att["explained"] == pytest.approx(0.0)
    out = tmp_path / "chrome.json"
    assert cli_here("export", slowed, "--format", "chrome", "-o", out).returncode == 0
    events = json.loads(out.read_text())["traceEvents"]
    critical = [e for e in events if e.get("cat") == "critical"]
    starts = [e for e in critical if e["ph"] == "s"]
    assert starts and len(starts) == len([e for e in critical if e["ph"] == "f"])
    assert {e["pid"] for e in critical if e["ph"] == "X"} & {2, 3}  # through the slow replica
    png = tmp_path / "t.png"
    assert cli_here("timeline", slowed, "-o", png).returncode == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.mpi
def test_a_placement_change_carries_each_stage_at_its_cores_speed(slowed):
    """The trace holds each rank's core speed (train.probe's product, timed at the step
    boundaries); whatif's restage brings a stage's costs to an average core by its rank's speed
    and the new stages to their own rank's: moving work from a slower core to a faster one makes
    it cheaper, equal speeds change nothing, and the work on an average core is kept."""
    from mpihybrid.analysis.replay import Measured, presplit

    trace = load(slowed)
    probe = trace.attrs["core_probe_s"]
    assert len(probe) == 4 and all(0 < x < 0.05 for x in probe), probe
    base = Measured.of(trace)
    assert base.speeds(1) == ((0, 1), [probe[2], probe[3]])  # replica 1: world ranks 2 and 3
    layout = BlockLayout.of(trace.config, 2)
    costs = presplit(base.costs[0][0])
    v = (0, 1, 1, 0)
    plain = layout.restage(costs, 4, v)
    even = layout.restage(costs, 4, v, ((0, 1), [2e-4, 2e-4]))
    assert even.forward == pytest.approx(plain.forward)
    slow1 = layout.restage(costs, 4, v, ((0, 1), [1e-4, 2e-4]))  # rank 1's core 2x slower
    factor = [2 / 3, 4 / 3]  # each core's time over the mean
    assert slow1.forward[3] == pytest.approx(plain.forward[3] / 2)  # rank 1's blocks on rank 0
    assert slow1.forward[0] == pytest.approx(plain.forward[0])  # rank 0's stay on rank 0
    average = sum(f / factor[r] for f, r in zip(slow1.forward, v, strict=True))
    measured = sum(f / factor[r] for f, r in zip(costs.forward, (0, 1), strict=True))
    assert average == pytest.approx(measured)
