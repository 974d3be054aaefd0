"""The trace file: rank 0 writes one HDF5 file of every rank's events as the run goes (a
TraceWriter, flushed at step boundaries); anyone reads it back.

    if comm.rank == 0:
        write_trace("runs/seed.h5", events=events, steps={"loss": losses}, config=toml, attrs={})
    trace = load("runs/seed.h5")                     # no MPI needed

The file layout is documented in docs/trace-format.md.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpihybrid.files import atomic_path
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND, KINDS

SCHEMA_VERSION = 2  # 2: written as the run goes (resizable, steps/step, finished)
FORMAT = "mpihybrid-trace"

# root attributes the writer owns; callers cannot set them through `attrs`
WRITER_ATTRS = (
    "format", "schema_version", "created", "updated", "complete", "finished", "json_attrs"
)  # fmt: skip


class TraceError(Exception):
    """A file that is not a readable, complete mpihybrid trace."""


# ---------------------------------------------------------------------------------------------
# writing (rank 0 only; no MPI)


def check_writable(path: str | os.PathLike, overwrite: bool, resuming: bool = False) -> None:
    """Raise now what write_trace would raise about `path`, before hours of training. A resumed
    run continues the trace at `path`: it must be a readable trace (TraceError otherwise)."""
    path = Path(path)
    if resuming and path.is_file() and not overwrite:
        load(path)
        overwrite = True
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write trace {path}: directory {parent} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"cannot write trace {path}: it is a directory")
    if path.exists() and not overwrite:
        raise FileExistsError(f"trace {path} already exists; choose another path or overwrite it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write trace {path}: directory {parent} is not writable")


def write_trace(
    path: str | os.PathLike,
    *,
    events: np.ndarray,
    steps: dict[str, np.ndarray],
    config: str,
    attrs: dict[str, Any],
    overwrite: bool = False,
) -> None:
    """Write one whole trace at once, all or nothing (a TraceWriter flushed once, finished)."""
    writer = TraceWriter(path, config=config, attrs=attrs, overwrite=overwrite)
    writer.start()
    writer.flush(events, steps, finished=True)


class TraceWriter:
    """Rank 0's trace of a run, published again at every flush so that a run stopped at any
    moment leaves the trace of every step up to its last flush.

        writer = TraceWriter(path, config=toml, attrs={...})
        writer.start(resume_step=None)                         # checks the path, writes nothing
        writer.flush(events, {"step": ..., "loss": ...})       # appends; the file is valid after
        writer.flush(rest, steps_rest, attrs={"runtime_s": 3.2}, finished=True)

    Every flush writes a temporary copy of the published file with the new rows appended to its
    resizable datasets, fsyncs it and renames it over the file (files.atomic_path): a reader
    sees the previous flush or this one, never half of one. start(resume_step) continues an
    existing trace after a resume from the checkpoint of that step: its rows of later steps
    (run again now) are dropped and the new rows' times continue after its last event.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        config: str,
        attrs: dict[str, Any],
        overwrite: bool = False,
    ) -> None:
        reserved = sorted(set(attrs) & set(WRITER_ATTRS))
        if reserved:
            raise ValueError(f"attrs {reserved} are set by the trace writer itself")
        self.path = Path(path)
        self.config = config
        self.attrs = dict(attrs)
        self.time_base = 0.0  # seconds added to new rows: after a resume, the earlier part's end
        self.flushes = 0
        self._earlier: Trace | None = None
        self._overwrite = overwrite

    def start(self, resume_step: int | None = None, earlier_steps: dict | None = None) -> None:
        """Check the path (TraceError, FileExistsError, ...) before the first flush. With
        resume_step, an existing trace there is continued from that step; earlier_steps (the
        checkpoint's per-step metrics, a list each by step) fill in the steps it lacks."""
        if resume_step is None:
            check_writable(self.path, self._overwrite)
            return
        if self.path.exists():
            self._earlier = _before_step(load(self.path), resume_step)
            if len(self._earlier.events):
                self.time_base = float(self._earlier.events["end"].max())
            self._overwrite = True
        check_writable(self.path, self._overwrite)
        if earlier_steps:
            self._earlier = _fill_steps(self._earlier, earlier_steps, resume_step, self.config)

    def flush(
        self,
        events: np.ndarray,
        steps: dict[str, np.ndarray],
        attrs: dict[str, Any] | None = None,
        finished: bool = False,
        evals: dict[str, np.ndarray] | None = None,
    ) -> None:
        """Append `events` (shifted by time_base), per-step rows and held-out evaluations
        (/eval), update the attributes and publish the file atomically."""
        if events.dtype != EVENT_DTYPE or events.ndim != 1:
            raise ValueError(f"events must be a 1-D array of EVENT_DTYPE, got {events.dtype}")
        self.attrs.update(attrs or {})
        if self.time_base and len(events):
            events = events.copy()
            events["start"] += self.time_base
            events["end"] += self.time_base
        with atomic_path(self.path, self._overwrite or self.flushes > 0) as tmp:
            if self.flushes:
                shutil.copyfile(self.path, tmp)
            with h5py.File(tmp, "a" if self.flushes else "w") as f:
                if not self.flushes:
                    self._create(f)
                _append(f["events"], events)
                for name, values in steps.items():
                    values = np.asarray(values)
                    _append(_steps_dataset(f["steps"], name, values), values)
                for name, values in (evals or {}).items():
                    group = f.require_group("eval")
                    _append(_steps_dataset(group, name, np.asarray(values)), np.asarray(values))
                f.attrs["updated"] = _now()
                f.attrs["finished"] = finished
                _write_attrs(f, self.attrs)
        self.flushes += 1

    def _create(self, f: h5py.File) -> None:
        f.attrs["format"] = FORMAT
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["created"] = _now()
        f.attrs["complete"] = True  # a published file always is: see atomic_path
        ds = f.create_dataset(
            "events",
            shape=(0,),
            dtype=EVENT_DTYPE,
            maxshape=(None,),
            chunks=(_EVENT_CHUNK,),
            compression="gzip",
            shuffle=True,
        )
        ds.attrs["kinds"] = list(KINDS)
        ds.attrs["time_unit"] = "s"
        group = f.create_group("steps")
        f.create_dataset("config", data=self.config, dtype=h5py.string_dtype())
        if self._earlier is not None:
            _append(ds, self._earlier.events)
            for name, values in self._earlier.steps.items():
                _append(_steps_dataset(group, name, values), values)
            for name, values in self._earlier.evals.items():
                _append(_steps_dataset(f.require_group("eval"), name, values), values)


_EVENT_CHUNK = 8192  # rows per HDF5 chunk of /events (about 400 KB before compression)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _append(ds: h5py.Dataset, rows: np.ndarray) -> None:
    n = ds.shape[0]
    if len(rows):
        ds.resize((n + len(rows),))
        ds[n:] = rows


def _steps_dataset(group: h5py.Group, name: str, values: np.ndarray) -> h5py.Dataset:
    if name not in group:
        group.create_dataset(name, shape=(0,), dtype=values.dtype, maxshape=(None,), chunks=(1024,))
    return group[name]


def _fill_steps(earlier: Trace | None, metrics: dict, resume_step: int, config: str) -> Trace:
    """`earlier` (or an empty trace) with a row for every step before resume_step: the rows it
    has, and the others from `metrics` (name -> values by step; step_time unknown: NaN)."""
    if earlier is None:
        earlier = Trace(np.zeros(0, EVENT_DTYPE), {}, config, {})
    have = earlier.step_numbers()
    missing = np.setdiff1d(np.arange(resume_step), have)
    steps = {"step": np.concatenate([have, missing])}
    for name in ("loss", "accuracy", "step_time"):
        old = np.asarray(earlier.steps.get(name, np.full(len(have), np.nan)), np.float64)
        new = [metrics[name][i] if i < len(metrics.get(name, ())) else np.nan for i in missing]
        steps[name] = np.concatenate([old, np.asarray(new, np.float64)])
    order = np.argsort(steps["step"], kind="stable")
    steps = {name: values[order] for name, values in steps.items()}
    return Trace(earlier.events, steps, earlier.config, earlier.attrs, earlier.evals)


def _before_step(trace: Trace, step: int) -> Trace:
    """The part of a trace before `step` (0-based): what a resume from that step keeps."""
    events = trace.events[trace.events["step"] < step]
    numbers = trace.step_numbers()
    keep = numbers < step
    steps = {name: values[keep] for name, values in trace.steps.items() if len(values) == len(keep)}
    steps["step"] = numbers[keep]
    evals = {}
    if "step" in trace.evals:
        before = trace.evals["step"] < step
        evals = {name: values[before] for name, values in trace.evals.items()}
    return Trace(events, steps, trace.config, trace.attrs, evals)


def _write_attrs(f: h5py.File, attrs: dict[str, Any]) -> None:
    # HDF5 attributes hold scalars and arrays; lists and dicts (hostnames, versions) go as JSON
    json_names = []
    for name, value in attrs.items():
        if isinstance(value, str | bool | int | float | np.generic | np.ndarray):
            f.attrs[name] = value
        else:
            f.attrs[name] = json.dumps(value)
            json_names.append(name)
    f.attrs["json_attrs"] = json_names


# ---------------------------------------------------------------------------------------------
# reading


@dataclass
class Trace:
    """A loaded trace: events (EVENT_DTYPE rows), per-step metrics, job TOML, root attributes."""

    events: np.ndarray
    steps: dict[str, np.ndarray]
    config: str
    attrs: dict[str, Any]
    evals: dict[str, np.ndarray] = field(default_factory=dict)  # /eval: held-out losses by step

    def kind(self, name: str) -> np.ndarray:
        """The rows of one event kind, e.g. trace.kind("allreduce")."""
        if name not in KIND:
            raise ValueError(f"unknown event kind {name!r}; kinds are {KINDS}")
        return self.events[self.events["kind"] == KIND[name]]

    def step_numbers(self) -> np.ndarray:
        """The 0-based step of each row of `steps` (version 1 traces: 0, 1, 2, ...)."""
        if "step" in self.steps:
            return np.asarray(self.steps["step"], dtype=np.int64)
        n = max((len(v) for v in self.steps.values()), default=0)
        return np.arange(n, dtype=np.int64)

    @property
    def has_actions(self) -> bool:
        """Whether the trace holds per-action events (false for trace.events = false runs,
        which keep one "step" row per rank and step)."""
        return bool(np.any(self.events["kind"] != KIND["step"]))


def load(path: str | os.PathLike) -> Trace:
    """Read a trace written by write_trace; TraceError with one sentence if it cannot."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"no trace file at {path}")
    if path.is_dir():
        raise TraceError(f"{path} is a directory, not a trace file")
    if not h5py.is_hdf5(path):
        raise TraceError(f"{path} is not an HDF5 file")
    try:
        with h5py.File(path, "r") as f:
            return _read(path, f)
    except TraceError:
        raise
    except (OSError, KeyError, ValueError, TypeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path} is truncated or corrupt ({err})") from err


def _read(path: Path, f: h5py.File) -> Trace:
    if f.attrs.get("format") != FORMAT:
        raise TraceError(f"{path} is an HDF5 file but not an mpihybrid trace")
    version = int(f.attrs.get("schema_version", -1))
    if version > SCHEMA_VERSION:
        raise TraceError(
            f"{path} has schema version {version}, newer than this reader's {SCHEMA_VERSION}: "
            "upgrade mpihybrid to read it"
        )
    if not bool(f.attrs.get("complete", False)):
        raise TraceError(f"{path} is from an incomplete run (complete=False)")

    ds = f["events"]
    if ds.dtype.names != EVENT_DTYPE.names:
        raise TraceError(
            f"{path} has events with columns {ds.dtype.names}, expected {EVENT_DTYPE.names}"
        )
    events = ds[...].astype(EVENT_DTYPE)
    steps = {name: dset[...] for name, dset in f["steps"].items()}
    evals = {name: dset[...] for name, dset in f["eval"].items()} if "eval" in f else {}
    config = f["config"].asstr()[()]

    json_names = set(_plain(f.attrs.get("json_attrs", [])))
    attrs = {}
    for name, value in f.attrs.items():
        if name == "json_attrs":
            continue
        attrs[name] = json.loads(value) if name in json_names else _plain(value)
    if version < 2:
        attrs.setdefault("finished", True)  # version 1 was written once, at the end of the run
    return Trace(events=events, steps=steps, config=config, attrs=attrs, evals=evals)


def _plain(value: Any) -> Any:
    # numpy scalars -> Python scalars, string arrays -> list[str]; numeric arrays stay arrays
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "OSU":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in value.tolist()]
    return value
