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
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpihybrid.files import atomic_path, h5_dataset_problem
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND, KINDS

SCHEMA_VERSION = 2  # 2: written as the run goes (resizable, steps/step, finished)
FORMAT = "mpihybrid-trace"

# root attributes the writer owns; callers cannot set them through `attrs`
WRITER_ATTRS = (
    "format", "schema_version", "created", "updated", "complete", "finished", "json_attrs",
    "file_id",
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
        events = np.concatenate([*(ev for ev, _ in parts), events])
        for group, rows in tables.items():
            earlier = [part_tables.get(group, {}) for _, part_tables in parts]
            for name in {name for part in earlier for name in part} | set(rows):
                pieces = [part[name] for part in earlier if name in part]
                rows[name] = np.concatenate([*pieces, *([rows[name]] if name in rows else [])])
        with atomic_path(self.path, self._overwrite or self.flushes > 0) as tmp:
            if self.flushes:
                shutil.copyfile(self.path, tmp)
            with h5py.File(tmp, "a" if self.flushes else "w") as f:
                if not self.flushes:
                    self._create(f)
                self._fill(f, events, tables, finished, self.attrs)
                f.attrs["file_id"] = file_id
                self._file_rows = f["events"].shape[0]
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

    def _fill(self, f: h5py.File, events: np.ndarray, tables: dict, finished: bool, attrs) -> None:
        _append(f["events"], events)
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
PART_FORMAT = "mpihybrid-trace-part"


def _read_part_rows(part: Path) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]:
    """The rows of a part this writer wrote: its events, and per-step metrics and held-out
    evaluations by group ("steps", "eval")."""
    with h5py.File(part, "r") as f:
        tables = {g: {n: ds[...] for n, ds in f[g].items()} for g in ("steps", "eval") if g in f}
        return f["events"][...], tables


def parts_dir(path: str | os.PathLike) -> Path:
    """Where the parts of the trace at `path` live (a hidden directory beside it)."""
    path = Path(path)
    return path.parent / f".{path.name}.parts"


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
    """Read a trace written by write_trace (its file and the parts written after it); TraceError
    with one sentence if it cannot, or if the file is not one this writer could have made:
    data stored elsewhere (links, external storage, virtual datasets), sizes the file does not
    hold, attributes or values out of their range (docs/robustness.md)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise TraceError(f"no trace file at {path}") from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise TraceError(f"{path} is a directory, not a trace file")
    if not stat.S_ISREG(mode):  # a FIFO or a device would block or never end
        raise TraceError(f"{path} is not a regular file")
    if not h5py.is_hdf5(path):
        raise TraceError(f"{path} is not an HDF5 file")
    where = path
    try:
        with h5py.File(path, "r") as f:
            trace, file_id = _read(path, f)
        for where in _parts_of(path, file_id):
            with h5py.File(where, "r") as f:
                _read_part(where, f, trace)
    except TraceError:
        raise
    except (OSError, KeyError, ValueError, TypeError, json.JSONDecodeError) as err:
        raise TraceError(f"{where} is truncated or corrupt ({err})") from err
    _check_values(path, trace)
    return trace


def _parts_of(path: Path, file_id: str) -> list[Path]:
    """The parts written after the file `file_id` was published, in order (none: a finished
    trace, or one written before parts existed)."""
    found = []
    if file_id and len(file_id) < 64 and file_id.isalnum():
        folder = parts_dir(path)
        while (part := folder / f"{file_id}-{len(found) + 1:06d}.h5").is_file():
            found.append(part)
    return found


def _read(path: Path, f: h5py.File) -> tuple[Trace, str]:
    if f.attrs.get("format") != FORMAT:
        raise TraceError(f"{path} is an HDF5 file but not an mpihybrid trace")
    version = _int_attr(path, f.attrs, "schema_version", -1)
    if version > SCHEMA_VERSION:
        raise TraceError(
            f"{path} has schema version {version}, newer than this reader's {SCHEMA_VERSION}: "
            "upgrade mpihybrid to read it"
        )
    if not bool(f.attrs.get("complete", False)):
        raise TraceError(f"{path} is from an incomplete run (complete=False)")
    size = path.stat().st_size
    events = _events(path, f, size)
    steps = _table(path, f, "steps", size)
    evals = _table(path, f, "eval", size) if "eval" in f else {}
    config = _dataset(path, f, "config", size).asstr()[()]
    attrs = _attrs(path, f, size)
    if version < 2:
        attrs.setdefault("finished", True)  # version 1 was written once, at the end of the run
    file_id = attrs.get("file_id", "")
    trace = Trace(events=events, steps=steps, config=config, attrs=attrs, evals=evals)
    return trace, str(file_id)


def _read_part(path: Path, f: h5py.File, trace: Trace) -> None:
    """Append one part's rows to `trace` and take its attributes (the newer ones)."""
    if f.attrs.get("format") != PART_FORMAT:
        raise TraceError(f"{path} is not a part of an mpihybrid trace")
    size = path.stat().st_size
    trace.events = np.concatenate([trace.events, _events(path, f, size)])
    for group, table in (("steps", trace.steps), ("eval", trace.evals)):
        rows = _table(path, f, group, size) if group in f else {}
        for name, values in rows.items():
            old = table.get(name)
            table[name] = values if old is None else np.concatenate([old, values])
    attrs = _attrs(path, f, size)
    newer = ("updated", "finished")
    trace.attrs.update({k: v for k, v in attrs.items() if k not in WRITER_ATTRS or k in newer})


def _events(path: Path, f: h5py.File, size: int) -> np.ndarray:
    ds = _dataset(path, f, "events", size)
    if ds.dtype.names != EVENT_DTYPE.names or ds.ndim != 1:
        raise TraceError(
            f"{path} has events with columns {ds.dtype.names}, expected {EVENT_DTYPE.names}"
        )
    return ds[...].astype(EVENT_DTYPE)


def _table(path: Path, f: h5py.File, name: str, size: int) -> dict[str, np.ndarray]:
    """The 1-D datasets of group /steps or /eval, each checked before it is read."""
    group = _member(path, f, name)
    if not isinstance(group, h5py.Group):
        raise TraceError(f"{path}: /{name} is not a group")
    names = list(group)
    if len(names) > MAX_STEP_METRICS:
        raise TraceError(
            f"{path}: /{name} holds {len(names)} datasets (at most {MAX_STEP_METRICS})"
        )
    return {key: _dataset(path, f, f"{name}/{key}", size)[...] for key in names}


def _member(path: Path, f: h5py.File, name: str):
    """f[name], refused when any link on the way is not a plain (hard) link."""
    group = f
    for part in name.split("/"):
        link = group.get(part, getlink=True)
        if link is None:
            raise TraceError(f"{path} has no /{name}")
        if not isinstance(link, h5py.HardLink):
            kind = "an external" if isinstance(link, h5py.ExternalLink) else "a soft"
            raise TraceError(f"{path}: /{name} is {kind} link; a trace holds its data itself")
        group = group[part]
    return group


def _dataset(path: Path, f: h5py.File, name: str, size: int) -> h5py.Dataset:
    ds = _member(path, f, name)
    if not isinstance(ds, h5py.Dataset):
        raise TraceError(f"{path}: /{name} is not a dataset")
    problem = h5_dataset_problem(ds, size)
    if problem:
        raise TraceError(f"{path}: /{name} {problem}")
    return ds


def _attrs(path: Path, f: h5py.File, size: int) -> dict[str, Any]:
    names = list(f.attrs)
    if len(names) > MAX_ATTRS:
        raise TraceError(f"{path} has {len(names)} attributes (at most {MAX_ATTRS})")
    for name in names:
        aid = f.attrs.get_id(name)
        stored = int(np.prod(aid.shape or (), dtype=np.int64)) * aid.get_type().get_size()
        if stored > min(size, MAX_ATTR_BYTES):
            raise TraceError(f"{path}: attribute {name} declares {stored} bytes")
    json_names = set(_plain(f.attrs.get("json_attrs", [])))
    attrs = {}
    for name in names:
        if name == "json_attrs":
            continue
        value = f.attrs[name]
        attrs[name] = json.loads(value) if name in json_names else _plain(value)
    return attrs


def _int_attr(path: Path, attrs, name: str, default: int) -> int:
    value = _plain(attrs.get(name, default))
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise TraceError(f"{path}: attribute {name} = {value!r} is not an integer")
    return int(value)


# what a trace may claim (a claim past these is a crafted or damaged file)
MAX_WORLD = 1 << 20  # ranks
MAX_MICROBATCHES = 1 << 16
MAX_VIRTUAL = 1 << 10
MAX_SCHEDULE_ACTIONS = 1 << 24  # pp * microbatches * virtual_stages: what analysis simulates
MAX_ATTRS = 256
MAX_ATTR_BYTES = 1 << 24
MAX_STEP_METRICS = 64


def _check_values(path: Path, trace: Trace) -> None:
    """The layout attributes in their ranges and every event in them: finite times, ranks
    below world_size, known kinds (TraceError naming the first bad one)."""
    attrs = trace.attrs
    world = None
    if "world_size" in attrs:
        world = _ranged(path, attrs, "world_size", 1, MAX_WORLD)
        pp = _ranged(path, attrs, "pp", 1, world) if "pp" in attrs else 1
        dp = _ranged(path, attrs, "dp", 1, world) if "dp" in attrs else world // pp
        if "pp" in attrs and "dp" in attrs and pp * dp != world:
            raise TraceError(f"{path}: pp({pp}) * dp({dp}) != world_size({world})")
        m = _ranged(path, attrs, "microbatches", 1, MAX_MICROBATCHES) if (
            "microbatches" in attrs) else 1  # fmt: skip
        v = _ranged(path, attrs, "virtual_stages", 1, MAX_VIRTUAL) if (
            "virtual_stages" in attrs) else 1  # fmt: skip
        if pp * m * v > MAX_SCHEDULE_ACTIONS:
            raise TraceError(
                f"{path}: pp({pp}) * microbatches({m}) * virtual_stages({v}) = {pp * m * v} "
                f"> {MAX_SCHEDULE_ACTIONS}"
            )
        placement = attrs.get("stage_ranks")
        if placement is not None and "pp" in attrs:
            placement = np.asarray(placement)
            if (
                placement.dtype.kind not in "iu" or placement.shape != (pp * v,)
                or placement.min(initial=0) < 0 or placement.max(initial=0) >= pp
            ):  # fmt: skip
                raise TraceError(
                    f"{path}: attribute stage_ranks is not {pp * v} pp ranks below pp({pp})"
                )
        for name, want in (("hostnames", str), ("peak_rss_bytes", int)):
            value = attrs.get(name)
            if value is not None and not (
                isinstance(value, list) and len(value) == world
                and all(isinstance(x, want) and not isinstance(x, bool) for x in value)
            ):  # fmt: skip
                raise TraceError(f"{path}: attribute {name} is not a list of {world} values")
    ev = trace.events
    bad = ~(np.isfinite(ev["start"]) & np.isfinite(ev["end"]))
    _first_bad(path, bad, "has a non-finite time (nan or inf)")
    _first_bad(path, ev["kind"] >= len(KINDS), "has an unknown kind")
    _first_bad(path, ev["step"] < 0, "has a negative step")
    if world is not None:
        _first_bad(path, (ev["rank"] < 0) | (ev["rank"] >= world), f"names a rank past {world}")
        _first_bad(path, (ev["peer"] < -1) | (ev["peer"] >= world), f"names a peer past {world}")
        if "pp" in attrs:  # (traces written by hand may leave out the layout)
            stages = pp * v
            out = (ev["stage"] < -1) | (ev["stage"] >= stages)
            _first_bad(path, out, f"names a stage past {stages}")
        if "dp" in attrs:
            out = (ev["replica"] < -1) | (ev["replica"] >= dp)
            _first_bad(path, out, f"names a replica past {dp}")
    numbers = trace.steps.get("step")
    if numbers is not None and (numbers.dtype.kind not in "iu" or np.any(numbers < 0)):
        raise TraceError(f"{path}: /steps/step holds a negative or non-integer step")


def _ranged(path: Path, attrs: dict, name: str, low: int, high: int) -> int:
    value = _int_attr(path, attrs, name, low)
    if not low <= value <= high:
        raise TraceError(f"{path}: attribute {name} = {value} is out of range [{low}, {high}]")
    return value


def _first_bad(path: Path, bad: np.ndarray, what: str) -> None:
    if bad.any():
        row = int(np.argmax(bad))
        raise TraceError(f"{path}: event row {row} {what} ({int(bad.sum())} such rows)")


def _plain(value: Any) -> Any:
    # numpy scalars -> Python scalars, string arrays -> list[str]; numeric arrays stay arrays
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "OSU":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in value.tolist()]
    return value
