"""Reading a trace: `load(path)` gives a Trace (its file and the parts written after it), every
size, link, attribute and value checked before it is believed (docs/robustness.md); the format's
names (FORMAT, SCHEMA_VERSION, where the parts live) that the writer (file.py) shares.

    trace = load("runs/seed.h5")                     # no MPI needed
    trace.kind("allreduce"), trace.steps["loss"], trace.attrs["pp"]

The file layout is documented in docs/trace-format.md.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpihybrid.files import h5_dataset_problem
from mpihybrid.trace.recorder import EVENT_DTYPE, EVENT_DTYPE_V2, KIND, KINDS

SCHEMA_VERSION = 3  # 2: written as the run goes (resizable, steps/step, finished); 3: events' cpu
FORMAT = "mpihybrid-trace"

# root attributes the writer owns; callers cannot set them through `attrs`
WRITER_ATTRS = (
    "format",
    "schema_version",
    "created",
    "updated",
    "complete",
    "finished",
    "json_attrs",
    "file_id",
)


class TraceError(Exception):
    """A file that is not a readable, complete mpihybrid trace."""


PART_FORMAT = "mpihybrid-trace-part"


def parts_dir(path: str | os.PathLike) -> Path:
    """Where the parts of the trace at `path` live (a hidden directory beside it)."""
    path = Path(path)
    return path.parent / f".{path.name}.parts"


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
    path = _trace_file(path)
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
    trace.events = by_start(trace.events)
    return trace


def by_start(events: np.ndarray) -> np.ndarray:
    """`events` in the format's order, by (start, rank) (unchanged where they are). Each flush's
    rows are gathered in that order, but a rank's clock offset is an estimate: on a loaded machine
    a rank's last rows of one flush can read later than another's first of the next."""
    return events if in_order(events) else events[np.lexsort((events["rank"], events["start"]))]


def in_order(events: np.ndarray) -> bool:
    """Whether `events` are sorted by (start, rank)."""
    start, rank = events["start"], events["rank"]
    later = start[1:] > start[:-1]
    return bool(np.all(later | ((start[1:] == start[:-1]) & (rank[1:] >= rank[:-1]))))


def root_attrs(path: str | os.PathLike) -> dict[str, Any]:
    """The root attributes of the trace file at `path` alone (no events, no parts read),
    bounded as load() bounds them; TraceError as load's."""
    path = _trace_file(path)
    try:
        with h5py.File(path, "r") as f:
            return _attrs(path, f, path.stat().st_size)
    except TraceError:
        raise
    except (OSError, KeyError, ValueError, TypeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path} is truncated or corrupt ({err})") from err


def _trace_file(path: str | os.PathLike) -> Path:
    """`path` when it is a regular HDF5 file, else TraceError saying what it is."""
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
    return path


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
    if ds.ndim == 1 and ds.dtype.names == EVENT_DTYPE_V2.names:  # version <= 2: no cpu column
        old = ds[...]
        rows = np.zeros(len(old), EVENT_DTYPE)
        for name in old.dtype.names:
            rows[name] = old[name]
        rows["cpu"] = np.nan
        return rows
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
        m = (
            _ranged(path, attrs, "microbatches", 1, MAX_MICROBATCHES)
            if ("microbatches" in attrs)
            else 1
        )
        v = (
            _ranged(path, attrs, "virtual_stages", 1, MAX_VIRTUAL)
            if ("virtual_stages" in attrs)
            else 1
        )
        if pp * m * v > MAX_SCHEDULE_ACTIONS:
            raise TraceError(
                f"{path}: pp({pp}) * microbatches({m}) * virtual_stages({v}) = {pp * m * v} "
                f"> {MAX_SCHEDULE_ACTIONS}"
            )
        placement = attrs.get("stage_ranks")
        if placement is not None and "pp" in attrs:
            placement = np.asarray(placement)
            if (
                placement.dtype.kind not in "iu"
                or placement.shape != (pp * v,)
                or placement.min(initial=0) < 0
                or placement.max(initial=0) >= pp
            ):
                raise TraceError(
                    f"{path}: attribute stage_ranks is not {pp * v} pp ranks below pp({pp})"
                )
        for name, want in (("hostnames", str), ("peak_rss_bytes", int), ("core_probe_s", float)):
            value = attrs.get(name)
            if value is not None and not (
                isinstance(value, list)
                and len(value) == world
                and all(isinstance(x, want) and not isinstance(x, bool) for x in value)
            ):
                raise TraceError(f"{path}: attribute {name} is not a list of {world} values")
        _check_row_probe(path, attrs, pp * v)
    ev = trace.events
    bad = ~(np.isfinite(ev["start"]) & np.isfinite(ev["end"]))
    _first_bad(path, bad, "has a non-finite time (nan or inf)")
    _first_bad(path, ev["kind"] >= len(KINDS), "has an unknown kind")
    _first_bad(path, ev["step"] < 0, "has a negative step")
    if world is not None:
        _first_bad(path, (ev["rank"] < 0) | (ev["rank"] >= world), f"names a rank past {world}")
        _first_bad(path, (ev["peer"] < -1) | (ev["peer"] >= world), f"names a peer past {world}")
        if "pp" in attrs:  # (traces written by hand may leave out the layout)
            stages = pp * v + (pp if attrs.get("vocab_parallel") else 0)  # + the shares
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


def _check_row_probe(path, attrs: dict, chunks: int) -> None:
    """row_probe_rows: two positive row counts; row_probe_s: six seconds a model chunk."""
    rows, seconds = attrs.get("row_probe_rows"), attrs.get("row_probe_s")
    if rows is None and seconds is None:
        return
    good_rows = (
        isinstance(rows, list)
        and len(rows) == 2
        and all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in rows)
    )
    good_seconds = (
        isinstance(seconds, list)
        and len(seconds) == 6 * chunks
        and all(isinstance(x, float) and math.isfinite(x) and x >= 0 for x in seconds)
    )
    if not (good_rows and good_seconds):
        raise TraceError(
            f"{path}: attributes row_probe_rows and row_probe_s are not two row counts and "
            f"6 x {chunks} seconds"
        )
