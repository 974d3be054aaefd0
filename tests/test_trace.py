"""Trace recorder, HDF5 writer/reader and its errors; gather_events under mpiexec."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from mpihybrid.trace.file import check_writable, write_trace
from mpihybrid.trace.read import SCHEMA_VERSION, TraceError, load
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND, KINDS, Recorder
from tests.helpers import results, run_mpi

CONFIG = '[grid]\npp = 2\ndp = 2\n\n[train]\nschedule = "1f1b"\nsteps = 3\n'
ATTRS = {
    "world_size": 4,
    "pp": 2,
    "dp": 2,
    "schedule": "1f1b",
    "mean_step_time": 0.125,
    "sync_sends": False,
    "versions": {"mpihybrid": "0.1.0", "numpy": np.__version__},
    "hostnames": ["node1", "node1", "node2", "node2"],
}


def sample_events(n: int, seed: int = 0) -> np.ndarray:
    """n events spread over 4 ranks with random times, recorded through a Recorder each."""
    rng = np.random.default_rng(seed)
    rows = []
    for rank in range(4):
        rec = Recorder(rank, replica=rank // 2, capacity=8)
        for i in range(n // 4):
            start = float(rng.uniform(0, 10))
            kind = int(rng.integers(len(KINDS)))
            rec.record(
                kind,
                i // 6,
                rank % 2,
                i % 6,
                start,
                start + float(rng.uniform(0, 1e-2)),
                int(rng.integers(1 << 20)),
                int(rng.integers(-1, 4)),
                float(rng.uniform(0, 1e-2)),  # the action's thread CPU seconds
            )
        rows.append(rec.events.copy())
    events = np.concatenate(rows)
    return events[np.lexsort((events["rank"], events["start"]))]


def write_sample(path, n: int = 64, **kwargs) -> np.ndarray:
    events = sample_events(n)
    steps = {
        "loss": np.array([2.3, 1.9, 1.4]),
        "accuracy": np.array([0.1, 0.4, 0.7], dtype=np.float32),
        "step_time": np.array([0.5, 0.25, 0.25]),
    }
    write_trace(path, events=events, steps=steps, config=CONFIG, attrs=ATTRS, **kwargs)
    return events


# --- recorder ------------------------------------------------------------------------------------


def test_kind_codes_are_positions():
    assert KIND["forward"] == 0
    assert [KIND[name] for name in KINDS] == list(range(len(KINDS)))
    assert EVENT_DTYPE["kind"] == np.uint8


def test_recorder_grows_by_doubling_and_keeps_every_field():
    rec = Recorder(rank=5, replica=2, capacity=2)
    for i in range(5):
        rec.record(
            KIND["send"],
            step=i,
            stage=1,
            microbatch=10 + i,
            start=i * 1.5,
            end=i * 1.5 + 0.25,
            nbytes=100 * i,
            peer=6,
        )
    rec.record(KIND["optimizer"], 7, 1, -1, 9.0, 9.5)
    assert rec.capacity == 8 and len(rec) == 6
    ev = rec.events
    assert ev.dtype == EVENT_DTYPE and len(ev) == 6
    assert (ev["rank"] == 5).all() and (ev["replica"] == 2).all() and (ev["stage"] == 1).all()
    np.testing.assert_array_equal(ev["kind"], [KIND["send"]] * 5 + [KIND["optimizer"]])
    np.testing.assert_array_equal(ev["step"], [0, 1, 2, 3, 4, 7])
    np.testing.assert_array_equal(ev["microbatch"], [10, 11, 12, 13, 14, -1])
    np.testing.assert_array_equal(ev["start"], [0.0, 1.5, 3.0, 4.5, 6.0, 9.0])
    np.testing.assert_array_equal(ev["end"] - ev["start"], [0.25] * 5 + [0.5])
    np.testing.assert_array_equal(ev["bytes"], [0, 100, 200, 300, 400, 0])
    np.testing.assert_array_equal(ev["peer"], [6] * 5 + [-1])


def test_recorder_rejects_unknown_kind():
    rec = Recorder(0, 0)
    with pytest.raises(ValueError, match=f"unknown event kind code {len(KINDS)}"):
        rec.record(len(KINDS), 0, 0, 0, 0.0, 1.0)
    assert len(rec) == 0


def test_recorder_clock_moves_forward():
    t0 = Recorder.clock()
    assert Recorder(0, 0).clock() >= t0


# --- write / load ------------------------------------------------------------------------------


def test_a_version_2_trace_reads_with_no_cpu_time(tmp_path):
    """Schema version 3 added the events' cpu column; an older file's rows read with NaN."""
    from mpihybrid.trace.recorder import EVENT_DTYPE_V2

    path = tmp_path / "run.h5"
    events = write_sample(path)
    with h5py.File(path, "r+") as f:
        old = np.zeros(len(events), EVENT_DTYPE_V2)
        for name in EVENT_DTYPE_V2.names:
            old[name] = events[name]
        del f["events"]
        f.create_dataset("events", data=old)
        f.attrs["schema_version"] = 2
    got = load(path).events
    assert got.dtype == EVENT_DTYPE and np.isnan(got["cpu"]).all()
    for name in EVENT_DTYPE_V2.names:
        np.testing.assert_array_equal(got[name], events[name])


def test_round_trip(tmp_path):
    path = tmp_path / "run.h5"
    events = write_sample(path)
    trace = load(path)

    assert trace.events.dtype == EVENT_DTYPE
    np.testing.assert_array_equal(trace.events, events)
    assert sorted(trace.steps) == ["accuracy", "loss", "step_time"]
    np.testing.assert_array_equal(trace.steps["loss"], [2.3, 1.9, 1.4])
    assert trace.steps["accuracy"].dtype == np.float32
    assert trace.config == CONFIG
    for name, value in ATTRS.items():
        assert trace.attrs[name] == value, name
    assert trace.attrs["format"] == "mpihybrid-trace"
    assert trace.attrs["schema_version"] == SCHEMA_VERSION
    assert trace.attrs["complete"] is True
    assert trace.attrs["created"].endswith("+00:00")

    sends = trace.kind("send")
    assert len(sends) == int((events["kind"] == KIND["send"]).sum()) > 0
    assert (sends["kind"] == KIND["send"]).all()
    with pytest.raises(ValueError, match="unknown event kind 'fwd'"):
        trace.kind("fwd")


def test_events_dataset_is_chunked_and_compressed(tmp_path):
    path = tmp_path / "run.h5"
    write_sample(path)
    with h5py.File(path, "r") as f:
        ds = f["events"]
        assert ds.compression == "gzip" and ds.shuffle and ds.chunks is not None
        assert list(ds.attrs["kinds"]) == list(KINDS)


def test_round_trip_without_events(tmp_path):
    path = tmp_path / "empty.h5"
    write_trace(path, events=np.zeros(0, EVENT_DTYPE), steps={}, config="", attrs={})
    trace = load(path)
    assert len(trace.events) == 0 and trace.steps == {} and trace.config == ""


def test_rejects_reserved_attrs_and_foreign_rows(tmp_path):
    path = tmp_path / "run.h5"
    events = sample_events(8)
    with pytest.raises(ValueError, match="schema_version"):
        write_trace(path, events=events, steps={}, config="", attrs={"schema_version": 9})
    with pytest.raises(ValueError, match="EVENT_DTYPE"):
        write_trace(path, events=np.zeros(3), steps={}, config="", attrs={})
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_and_keeps_original(tmp_path):
    path = tmp_path / "run.h5"
    write_sample(path)
    original = path.read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        write_sample(path, n=16)
    with pytest.raises(FileExistsError):
        check_writable(path, overwrite=False)
    assert path.read_bytes() == original

    check_writable(path, overwrite=True)
    events = write_sample(path, n=16, overwrite=True)
    assert len(load(path).events) == len(events) == 16


def test_failed_write_leaves_no_file_and_no_temporary(tmp_path):
    path = tmp_path / "run.h5"
    bad_steps = {"loss": np.array([1.0]), "note": np.array([object()], dtype=object)}
    with pytest.raises(TypeError):
        write_trace(path, events=sample_events(8), steps=bad_steps, config="", attrs={})
    assert list(tmp_path.iterdir()) == []

    # a failed overwrite keeps the previous trace intact
    write_sample(path)
    original = path.read_bytes()
    with pytest.raises(TypeError):
        write_trace(
            path, events=sample_events(8), steps=bad_steps, config="", attrs={}, overwrite=True
        )
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["run.h5"]


def test_missing_directory_is_a_clear_error(tmp_path):
    path = tmp_path / "no" / "such" / "run.h5"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_writable(path, overwrite=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_sample(path)


def test_check_writable_does_not_create_anything(tmp_path):
    check_writable(tmp_path / "run.h5", overwrite=False)
    with pytest.raises(IsADirectoryError):
        check_writable(tmp_path, overwrite=True)
    assert list(tmp_path.iterdir()) == []


# --- reader errors -------------------------------------------------------------------------------


def _set_root_attr(path, name, value):
    with h5py.File(path, "a") as f:
        f.attrs[name] = value


def make_missing(path):
    pass


def make_text(path):
    path.write_text("step,loss\n0,2.3\n")


def make_truncated(path):
    full = path.with_suffix(".full.h5")
    write_sample(full, n=4000)
    data = full.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def make_foreign(path):
    with h5py.File(path, "w") as f:
        f["weights"] = np.arange(10.0)
        f.attrs["format"] = "someone-else"


def make_newer(path):
    write_sample(path)
    _set_root_attr(path, "schema_version", SCHEMA_VERSION + 1)


def make_incomplete(path):
    write_sample(path)
    _set_root_attr(path, "complete", False)


@pytest.mark.parametrize(
    "make, message",
    [
        (make_missing, "no trace file"),
        (make_text, "not an HDF5 file"),
        (make_truncated, "truncated or corrupt"),
        (make_foreign, "not an mpihybrid trace"),
        (make_newer, f"schema version {SCHEMA_VERSION + 1}, newer"),
        (make_incomplete, "incomplete run"),
    ],
)
def test_load_errors(tmp_path, make, message):
    path = tmp_path / "run.h5"
    make(path)
    with pytest.raises(TraceError, match=message) as info:
        load(path)
    assert str(path) in str(info.value)


# --- under mpiexec -------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 3, 4])
def test_gather_events_and_clock_offsets(tmp_path, n):
    out = tmp_path / "run.h5"
    proc = run_mpi(n, "-m", "mpi4py", "tests/_mpi_trace.py", str(out), timeout=60)
    (result,) = results(proc)
    print(n, "ranks, clock offsets (s):", result["offsets"])

    expected_rows = [0 if rank == 1 else 3 + 5 * rank for rank in range(n)]
    assert result["rows_per_rank"] == expected_rows
    assert result["match_local"] and result["sorted"] and result["relative_is_shifted_raw"]
    assert 0.0 <= result["min_start"] < 10.0  # seconds since the run started
    assert result["offsets"][0] == 0.0
    assert all(abs(offset) < 10e-3 for offset in result["offsets"])
    assert result["loaded_equal"]
    assert result["loaded_world_size"] == n and result["loaded_hostnames"] == n
    assert load(out).attrs["world_size"] == n
    assert [p.name for p in tmp_path.iterdir()] == ["run.h5"]
