"""The trace file: rank 0 writes one HDF5 file of every rank's events; anyone reads it back.

    if comm.rank == 0:
        write_trace("runs/seed.h5", events=events, steps={"loss": losses}, config=toml, attrs={})
    trace = load("runs/seed.h5")                     # no MPI needed

The file layout is documented in docs/trace-format.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpihybrid.files import atomic_path
from mpihybrid.trace.recorder import EVENT_DTYPE, KIND, KINDS

SCHEMA_VERSION = 1
FORMAT = "mpihybrid-trace"

# root attributes the writer owns; callers cannot set them through `attrs`
_RESERVED_ATTRS = ("format", "schema_version", "created", "complete", "json_attrs")


class TraceError(Exception):
    """A file that is not a readable, complete mpihybrid trace."""


# ---------------------------------------------------------------------------------------------
# writing (rank 0 only; no MPI)


def check_writable(path: str | os.PathLike, overwrite: bool) -> None:
    """Raise now what write_trace would raise about `path`, before hours of training."""
    path = Path(path)
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
    """Write one trace all or nothing (files.atomic_path: temporary, fsync, rename)."""
    path = Path(path)
    check_writable(path, overwrite)
    if events.dtype != EVENT_DTYPE or events.ndim != 1:
        raise ValueError(f"events must be a 1-D array of EVENT_DTYPE, got {events.dtype}")
    reserved = sorted(set(attrs) & set(_RESERVED_ATTRS))
    if reserved:
        raise ValueError(f"attrs {reserved} are set by write_trace itself")

    with atomic_path(path, overwrite) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        f.attrs["complete"] = False  # turned True only once everything below is written
        _write_attrs(f, attrs)

        ds = f.create_dataset(
            "events",
            data=events,
            maxshape=(None,),
            chunks=(max(1, min(len(events), 8192)),),
            compression="gzip",
            shuffle=True,
        )
        ds.attrs["kinds"] = list(KINDS)
        ds.attrs["time_unit"] = "s"

        group = f.create_group("steps")
        for name, values in steps.items():
            group.create_dataset(name, data=np.asarray(values))

        f.create_dataset("config", data=config, dtype=h5py.string_dtype())
        f.attrs["complete"] = True


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

    def kind(self, name: str) -> np.ndarray:
        """The rows of one event kind, e.g. trace.kind("allreduce")."""
        if name not in KIND:
            raise ValueError(f"unknown event kind {name!r}; kinds are {KINDS}")
        return self.events[self.events["kind"] == KIND[name]]

    def to_pandas(self):
        """The events as a pandas DataFrame, with `kind` as names (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError("Trace.to_pandas() needs pandas: pip install pandas") from err
        frame = pd.DataFrame({name: self.events[name] for name in EVENT_DTYPE.names})
        frame["kind"] = pd.Categorical.from_codes(self.events["kind"], categories=list(KINDS))
        return frame


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
    config = f["config"].asstr()[()]

    json_names = set(_plain(f.attrs.get("json_attrs", [])))
    attrs = {}
    for name, value in f.attrs.items():
        if name == "json_attrs":
            continue
        attrs[name] = json.loads(value) if name in json_names else _plain(value)
    return Trace(events=events, steps=steps, config=config, attrs=attrs)


def _plain(value: Any) -> Any:
    # numpy scalars -> Python scalars, string arrays -> list[str]; numeric arrays stay arrays
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "OSU":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in value.tolist()]
    return value
