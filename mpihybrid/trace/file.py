"""Writing the trace file: rank 0 writes one HDF5 file of every rank's events as the run goes (a
TraceWriter, flushed at step boundaries); anyone reads it back (read.py).

    if comm.rank == 0:
        write_trace("runs/seed.h5", events=events, steps={"loss": losses}, config=toml, attrs={})

The file layout is documented in docs/trace-format.md.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpihybrid.files import atomic_path
from mpihybrid.progress import progress
from mpihybrid.trace.read import (
    FORMAT,
    PART_FORMAT,
    SCHEMA_VERSION,
    WRITER_ATTRS,
    Trace,
    by_start,
    in_order,
    load,
    parts_dir,
)
from mpihybrid.trace.recorder import EVENT_DTYPE, KINDS

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
    """Rank 0's trace of a run, brought up to date at every flush so that a run stopped at any
    moment leaves the trace of every step up to its last flush.

        writer = TraceWriter(path, config=toml, attrs={...})
        writer.start(resume_step=None)                         # checks the path, writes nothing
        writer.flush(events, {"step": ..., "loss": ...})       # appends; the file is valid after
        writer.flush(rest, steps_rest, attrs={"runtime_s": 3.2}, finished=True)

    The first flush publishes the file (temporary, fsync, rename: files.atomic_path). A later
    flush writes only its new rows, as the next part `.NAME.parts/ID-000001.h5` (atomically too),
    which load() reads after the file whose `file_id` is ID: a reader sees the previous flush or
    this one, never half of one, and a flush costs its own rows, not the whole file. The parts
    are merged into a new file (new file_id, then the parts removed) when they hold as many bytes
    as the file or number MAX_PARTS, and always at the finished flush: a finished trace is one
    file, and the bytes copied stay within a few times the trace's size.

    A flush the file system refuses raises its OSError and leaves the trace as the flush before
    left it (the running trace, TraceStream, then stops with a warning and training goes on).

    start(resume_step) continues an existing trace after a resume from the checkpoint of that
    step: its rows of later steps (run again now) are dropped and the new rows' times continue
    after its last event.
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
        self._file_id = ""
        self._file_rows = 0  # event rows in the published file
        self._parts: dict[Path, int] = {}  # parts written since the file was published: rows
        self._new_attrs: dict[str, Any] = {}  # attributes set since then (the parts carry them)

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
        (/eval) and update the attributes: a new part, or the whole file published again (see
        the class)."""
        if events.dtype != EVENT_DTYPE or events.ndim != 1:
            raise ValueError(f"events must be a 1-D array of EVENT_DTYPE, got {events.dtype}")
        self.attrs.update(attrs or {})
        self._new_attrs.update(attrs or {})
        if self.time_base and len(events):
            events = events.copy()
            events["start"] += self.time_base
            events["end"] += self.time_base
        tables = {
            "steps": {name: np.asarray(values) for name, values in steps.items()},
            "eval": {name: np.asarray(values) for name, values in (evals or {}).items()},
        }
        if not self.flushes or finished or self._merge_due():
            self._publish(events, tables, finished)
        else:
            self._write_part(events, tables, finished)
        self.flushes += 1

    def _merge_due(self) -> bool:
        """Whether this flush publishes the whole file: once the parts hold as many event rows
        as the file (at least a chunk), so each row is copied a bounded number of times, or
        when they number MAX_PARTS."""
        rows = sum(self._parts.values())
        return len(self._parts) >= MAX_PARTS or rows >= max(self._file_rows, _EVENT_CHUNK)

    def _publish(self, events: np.ndarray, tables: dict, finished: bool) -> None:
        """The whole file again, under a new file_id: the last file, its parts and these rows,
        appended at once (an append rewrites the dataset's last chunk: once per publish)."""
        file_id = secrets.token_hex(8)
        parts = [_read_part_rows(part) for part in self._parts]
        progress("trace flush")
        events = np.concatenate([*(ev for ev, _ in parts), events])
        for group, rows in tables.items():
            earlier = [part_tables.get(group, {}) for _, part_tables in parts]
            for name in {name for part in earlier for name in part} | set(rows):
                pieces = [part[name] for part in earlier if name in part]
                rows[name] = np.concatenate([*pieces, *([rows[name]] if name in rows else [])])
        with atomic_path(self.path, self._overwrite or self.flushes > 0) as tmp:
            if self.flushes:
                shutil.copyfile(self.path, tmp)
                progress("trace flush")
            with h5py.File(tmp, "a" if self.flushes else "w") as f:
                if not self.flushes:
                    self._create(f)
                self._fill(f, events, tables, finished, self.attrs)
                f.attrs["file_id"] = file_id
                self._file_rows = f["events"].shape[0]
            progress("trace flush")
        self._file_id = file_id
        self._parts = {}
        self._new_attrs = {}
        remove_parts(self.path)

    def _write_part(self, events: np.ndarray, tables: dict, finished: bool) -> None:
        folder = parts_dir(self.path)
        folder.mkdir(exist_ok=True)
        part = folder / f"{self._file_id}-{len(self._parts) + 1:06d}.h5"
        with atomic_path(part) as tmp, h5py.File(tmp, "w", libver="latest") as f:
            f.attrs["format"] = PART_FORMAT
            f.create_dataset("events", data=events, dtype=EVENT_DTYPE)
            for group_name, rows in tables.items():
                group = f.create_group(group_name)
                for name, values in rows.items():
                    group.create_dataset(name, data=values)
            f.attrs["updated"] = _now()
            f.attrs["finished"] = finished
            _write_attrs(f, self._new_attrs)  # the file has the others
        self._parts[part] = len(events)
        progress("trace flush")

    def _fill(self, f: h5py.File, events: np.ndarray, tables: dict, finished: bool, attrs) -> None:
        ds, events = f["events"], by_start(events)
        n = ds.shape[0]
        if n and len(events) and not in_order(np.concatenate([ds[n - 1 :], events[:1]])):
            events = by_start(np.concatenate([ds[:], events]))  # a skewed clock's rows: rare,
            ds.resize((0,))  # the whole table rewritten in order
        _append(ds, events)
        for group, rows in tables.items():
            for name, values in rows.items():
                _append(_steps_dataset(f.require_group(group), name, values), values)
        f.attrs["updated"] = _now()
        f.attrs["finished"] = finished
        _write_attrs(f, attrs)

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


MAX_PARTS = 256  # parts a trace holds at most before they are merged into its file


def _read_part_rows(part: Path) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]:
    """The rows of a part this writer wrote: its events, and per-step metrics and held-out
    evaluations by group ("steps", "eval")."""
    with h5py.File(part, "r") as f:
        tables = {g: {n: ds[...] for n, ds in f[g].items()} for g in ("steps", "eval") if g in f}
        return f["events"][...], tables


def remove_parts(path: str | os.PathLike) -> None:
    """Remove the parts directory of `path` (after its parts were merged, or left by a run
    whose file has since been published again: parts of another file_id are never read)."""
    shutil.rmtree(parts_dir(path), ignore_errors=True)


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
    names = ["loss", "accuracy", "step_time"]
    names += sorted((set(metrics) | set(earlier.steps)) - {"step", *names})  # lr, grad_norm
    for name in names:
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
