"""Trace: every rank records what it did and when; rank 0 writes one HDF5 file.

    rec = Recorder(rank, replica=grid.dp_rank)
    offset = clock_offset(comm)                      # once, before training
    t0 = rec.clock(); forward(...); rec.record(KIND["forward"], step, stage, mb, t0, rec.clock())
    events = gather_events(comm, rec, offset)        # collective; rows on rank 0, None elsewhere
    if comm.rank == 0:
        write_trace("runs/seed.h5", events=events, steps={"loss": losses}, config=toml, attrs={})
    trace = load("runs/seed.h5")                     # no MPI needed

The file layout is documented in docs/trace-format.md.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger(__name__)

KINDS = ("forward", "backward", "weight", "send", "recv", "allreduce", "optimizer", "step")
KIND = {name: code for code, name in enumerate(KINDS)}
EVENT_DTYPE = np.dtype(
    [
        ("rank", "<i4"),
        ("stage", "<i4"),
        ("replica", "<i4"),
        ("kind", "u1"),
        ("step", "<i4"),
        ("microbatch", "<i4"),
        ("start", "<f8"),
        ("end", "<f8"),
        ("bytes", "<i8"),
        ("peer", "<i4"),
    ]
)
SCHEMA_VERSION = 1
FORMAT = "mpihybrid-trace"

# root attributes the writer owns; callers cannot set them through `attrs`
_RESERVED_ATTRS = ("format", "schema_version", "created", "complete", "json_attrs")
_CLOCK_TAG = 32767  # the largest tag MPI guarantees; used only before any other traffic


class TraceError(Exception):
    """A file that is not a readable, complete mpihybrid trace."""


class Recorder:
    """One rank's events, appended into a preallocated structured array."""

    clock = staticmethod(time.perf_counter)  # the clock every start/end is read from

    def __init__(self, rank: int, replica: int, capacity: int = 4096) -> None:
        self.rank = rank
        self.replica = replica
        self._rows = np.zeros(max(1, capacity), dtype=EVENT_DTYPE)
        self._n = 0

    def record(
        self,
        kind: int,
        step: int,
        stage: int,
        microbatch: int,
        start: float,
        end: float,
        nbytes: int = 0,
        peer: int = -1,
    ) -> None:
        # hot path: one tuple store; the check stops an unknown code wrapping silently in u1
        if not 0 <= kind < len(KINDS):
            raise ValueError(f"unknown event kind code {kind}; kinds are {KINDS}")
        if self._n == len(self._rows):
            self._grow()
        self._rows[self._n] = (
            self.rank, stage, self.replica, kind, step, microbatch, start, end, nbytes, peer
        )  # fmt: skip
        self._n += 1

    def _grow(self) -> None:
        rows = np.zeros(2 * len(self._rows), dtype=EVENT_DTYPE)
        rows[: self._n] = self._rows[: self._n]
        self._rows = rows

    @property
    def events(self) -> np.ndarray:
        """The filled rows (a view: copy before keeping it past the next record)."""
        return self._rows[: self._n]

    @property
    def capacity(self) -> int:
        return len(self._rows)

    def __len__(self) -> int:
        return self._n


class StepRecorder(Recorder):
    """Keeps only the per-step rows: what a run costs without per-action tracing."""

    def record(self, kind: int, step: int, *args, **kwargs) -> None:
        if kind == KIND["step"]:
            super().record(kind, step, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# clocks and gathering (collective over comm)


def clock_offset(comm: MPI.Comm, rounds: int = 16) -> float:
    """Seconds to add to this rank's clock to read rank 0's clock; 0.0 on rank 0.

    Each rank ping-pongs with rank 0 `rounds` times; rank 0 answers with its clock. Assuming the
    reply was read halfway through the round trip, offset = t_rank0 - (t_send + t_recv) / 2; the
    round with the shortest trip is kept, so the error is at most half of that trip.
    """
    from mpi4py import MPI

    clock = Recorder.clock
    buf = np.zeros(1, dtype=np.float64)
    if comm.rank == 0:
        # serve one rank at a time so each round trip measures only the two ranks involved
        for peer in range(1, comm.size):
            for _ in range(rounds):
                comm.Recv([buf, MPI.DOUBLE], source=peer, tag=_CLOCK_TAG)
                buf[0] = clock()
                comm.Send([buf, MPI.DOUBLE], dest=peer, tag=_CLOCK_TAG)
        return 0.0
    best_trip, best_offset = float("inf"), 0.0
    for _ in range(rounds):
        t_send = clock()
        comm.Send([buf, MPI.DOUBLE], dest=0, tag=_CLOCK_TAG)
        comm.Recv([buf, MPI.DOUBLE], source=0, tag=_CLOCK_TAG)
        t_recv = clock()
        if t_recv - t_send < best_trip:
            best_trip = t_recv - t_send
            best_offset = float(buf[0]) - (t_send + t_recv) / 2
    log.debug("clock offset %+.6f s (round trip %.1f us)", best_offset, best_trip * 1e6)
    return best_offset


def gather_events(comm: MPI.Comm, recorder: Recorder, offset: float) -> np.ndarray | None:
    """Every rank's events, times plus `offset`, sorted by (start, rank) on rank 0; None elsewhere.

    With offset = clock_offset(comm) the times read rank 0's clock; pass clock_offset(comm) - t0,
    t0 being the run's start on rank 0's clock, for seconds since the run started.
    """
    from mpi4py import MPI

    rows = recorder.events.copy()
    rows["start"] += offset
    rows["end"] += offset
    is_root = comm.rank == 0

    counts = np.zeros(comm.size, dtype=np.int64) if is_root else None
    comm.Gather(np.array([len(rows)], dtype=np.int64), counts, root=0)
    # counted in rows, not bytes, so a long trace does not overflow MPI's int counts
    row_type = MPI.BYTE.Create_contiguous(EVENT_DTYPE.itemsize).Commit()
    try:
        if is_root:
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
            gathered = np.zeros(int(counts.sum()), dtype=EVENT_DTYPE)
            recvbuf = [gathered.view(np.uint8), (counts, displs), row_type]
        else:
            recvbuf = None
        comm.Gatherv([rows.view(np.uint8), len(rows), row_type], recvbuf, root=0)
    finally:
        row_type.Free()
    if not is_root:
        return None

    return gathered[np.lexsort((gathered["rank"], gathered["start"]))]


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
    """Write one trace atomically: a temporary file in the same directory, then os.replace()."""
    path = Path(path)
    check_writable(path, overwrite)
    if events.dtype != EVENT_DTYPE or events.ndim != 1:
        raise ValueError(f"events must be a 1-D array of EVENT_DTYPE, got {events.dtype}")
    reserved = sorted(set(attrs) & set(_RESERVED_ATTRS))
    if reserved:
        raise ValueError(f"attrs {reserved} are set by write_trace itself")

    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    # O_EXCL: never clobber another writer's temporary; mode 0o666 lets the umask decide
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        with h5py.File(tmp, "w") as f:
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
            f.flush()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
