"""Reading flight records back (`mpihybrid why RUN`): which records belong to the run, what each
rank was doing, and which rank -- or which node -- the others waited on.

    directory, records, notes = read_records("runs/x.h5")   # notes: records left out, and why
    print("\n".join(notes + explain(records, hosts)))

A record is read only as train.flight writes it, and what is printed is bounded whatever a file
claims: every string is cut, ranks without a record are printed as ranges, at most
MAX_RANK_LINES ranks are described one by one.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from mpihybrid.train.flight import FLIGHT_ROWS, MAX_WORLD, RECORD_ATTRS, RECORD_DTYPE, describe

MAX_FILES = 1 << 16  # record files read from one directory
MAX_TEXT = 200  # characters of any string a record holds (a reason, a host name)
MAX_RANK_LINES = 64  # ranks described one by one; the rest are counted


def _text(value) -> str:
    """A record's string attribute, printable and cut at MAX_TEXT characters."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = " ".join(str(value).split())
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


def read_records(path: str | Path) -> tuple[Path, dict[int, tuple[dict, np.ndarray]], list[str]]:
    """The flight records of the run a trace (RUN.h5) or a record directory explains: rank ->
    (attrs, rows), and notes on the records left out: those of an earlier run (older than the
    trace's run, or than the newest run the directory holds). ValueError with one line when
    there is none or a file is not one."""
    path = Path(path)
    directory = path if path.is_dir() else path.with_name(path.stem + ".flight")
    if not directory.is_dir():
        raise ValueError(f"no flight records at {directory} (written when a run ends abnormally)")
    files = []
    for file in directory.glob("rank*.h5"):
        files.append(file)
        if len(files) > MAX_FILES:
            raise ValueError(f"{directory} holds over {MAX_FILES} record files")
    found: dict[int, tuple[dict, np.ndarray]] = {}
    for file in sorted(files):
        found.update([_read_record(file)])
    if not found:
        raise ValueError(f"no flight records in {directory}")
    started = _trace_started(path) if not path.is_dir() else None
    records, notes = _this_run(found, started)
    if not records:
        raise ValueError(notes[0])
    return directory, records, notes


def trace_hosts(path: str | Path) -> list[str] | None:
    """Each rank's host by world rank from the trace beside the records (None without one)."""
    from mpihybrid.trace.read import TraceError, root_attrs

    path = Path(path)
    if path.is_dir() or not path.is_file():
        return None
    try:
        hosts = root_attrs(path).get("hostnames")
    except TraceError:
        return None
    ok = isinstance(hosts, list) and len(hosts) <= MAX_WORLD
    return [_text(h) for h in hosts] if ok else None


def _trace_started(path: Path) -> float | None:
    """When the run that wrote the trace at `path` started (its attribute run_started_at)."""
    from mpihybrid.trace.read import TraceError, root_attrs

    if not path.is_file():
        return None
    try:
        value = root_attrs(path).get("run_started_at")
    except TraceError:
        return None
    return float(value) if isinstance(value, int | float) and np.isfinite(value) else None


def _this_run(found: dict, started: float | None) -> tuple[dict, list[str]]:
    """The records of the run explained, by its identity: the run_started every rank of a run
    got from rank 0 at its start (the same bits in each record and in the trace's
    run_started_at), the trace's run when there is a trace, else the newest run among the
    records. Not a time window: a restart a second after a stall is another run."""
    if started is None:
        starts = [float(a["run_started"]) for a, _ in found.values() if "run_started" in a]
        started = max(starts) if starts else None
    if started is None:  # records of an older version: no way to tell runs apart
        return found, []
    keep = {r: rec for r, rec in found.items() if _started(rec[0]) == started}
    left = sorted(set(found) - set(keep))
    if not left:
        return keep, []
    last = max(float(found[r][0]["written_at"]) for r in left)
    what = (
        f"{len(left)} record(s) of an earlier run (rank {_ranges(left)}, written up to "
        f"{_stamp(last)})"
    )
    if not keep:
        since = f" (it started at {_stamp(started)})" if started is not None else ""
        return {}, [f"no flight record of this run{since}: only {what}; the run wrote none"]
    return keep, [f"left out: {what}"]


def _started(attrs: dict) -> float | None:
    value = attrs.get("run_started")
    return float(value) if value is not None else None


def _read_record(file: Path) -> tuple[int, tuple[dict, np.ndarray]]:
    """One rank's record, read only when it is one this recorder could have written: a regular
    HDF5 file, its rows a plain dataset kept in the file, at most FLIGHT_ROWS of them, scalar
    attributes; strings cut at MAX_TEXT."""
    import h5py

    from mpihybrid.files import h5_dataset_problem

    if not file.is_file() or file.is_symlink() or not h5py.is_hdf5(file):
        raise ValueError(f"{file}: not an mpihybrid flight record")
    refused = ValueError(f"{file}: not an mpihybrid flight record")
    try:
        with h5py.File(file, "r") as f:
            link = f.get("rows", getlink=True)
            rows = f.get("rows") if isinstance(link, h5py.HardLink) else None
            if (
                f.attrs.get("format") != "mpihybrid-flight-1"
                or not isinstance(rows, h5py.Dataset)
                or rows.dtype != RECORD_DTYPE
                or rows.ndim != 1
                or rows.shape[0] > FLIGHT_ROWS
                or h5_dataset_problem(rows, file.stat().st_size)
            ):
                raise refused
            attrs = {}
            for key in (*RECORD_ATTRS, "run_started"):
                if key in f.attrs:
                    aid = f.attrs.get_id(key)
                    if aid.shape not in ((), None) or aid.get_type().get_size() > 4096:
                        raise refused
                    attrs[key] = f.attrs[key]
            world, rank = int(attrs.get("world_size", -1)), int(attrs.get("rank", -1))
            if not set(RECORD_ATTRS) <= set(attrs) or not 0 <= rank < world <= MAX_WORLD:
                raise refused
            for key in ("reason", "host", "format"):
                attrs[key] = _text(attrs[key])
            for key in ("written_at", "run_started"):
                if key in attrs and not np.isfinite(float(attrs[key])):
                    raise refused
            return rank, (attrs, rows[()])
    except (OSError, KeyError, TypeError) as exc:
        raise ValueError(f"{file}: unreadable ({_text(exc)})") from None


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8' (at most 8 pieces, then '...')."""
    pieces, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            pieces.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(pieces[:8]) + (f", ... ({len(ranks)} ranks)" if len(pieces) > 8 else "")


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _rank_line(rank: int, attrs: dict, rows: np.ndarray) -> tuple[str, np.void | None]:
    head = f"rank {rank} (pp {int(attrs['pp_rank'])}, dp {int(attrs['dp_rank'])}, {attrs['host']})"
    running = rows[np.isnan(rows["end"])]
    done = rows[~np.isnan(rows["end"])]
    last = f"; last done: {describe(done[-1])}" if len(done) else ""
    if len(running):
        return f"{head}: in {describe(running[-1], float(attrs['written_at']))}{last}", running[-1]
    return f"{head}: between actions{last}", None


def explain(
    records: dict[int, tuple[dict, np.ndarray]], hosts: list[str] | None = None
) -> list[str]:
    """What each rank was doing when the job ended, and which rank (or node) the others waited
    on. hosts: each rank's host by world rank (the trace's), for ranks that left no record."""
    world = max(int(a["world_size"]) for a, _ in records.values())
    world = max(world, max(records) + 1)
    written = max(float(a["written_at"]) for a, _ in records.values())
    lines, waits = [], {}
    for rank in sorted(records):
        attrs, rows = records[rank]
        line, row = _rank_line(rank, attrs, rows)
        if row is not None and 0 <= int(row["peer"]) < world:
            waits[rank] = int(row["peer"])
        if len(lines) < 2 * MAX_RANK_LINES:
            lines += [line, f"    ended by: {attrs['reason']}"]
    if len(records) > MAX_RANK_LINES:
        lines.append(f"... and {len(records) - MAX_RANK_LINES} more ranks with a record (--json)")
    missing = [r for r in range(world) if r not in records]
    if missing:
        lines.append(
            f"rank {_ranges(missing)}: no record (stopped or killed before it could write one)"
        )
    host_of = {r: h for r, h in enumerate(hosts or []) if r < world}
    host_of.update({r: a["host"] for r, (a, _) in records.items()})
    lines.append(_verdict(records, waits, missing, host_of, world))
    lines.insert(
        0, f"flight records of {len(records)} of {world} ranks, the last at {_stamp(written)}"
    )
    return [line for line in lines if line]


def _verdict(records, waits: dict[int, int], missing: list[int], host_of: dict, world: int) -> str:
    """The one line naming where the job stopped: a cut link between two nodes when every rank
    of a node that names a peer waits on ranks of one other node; else the rank most waited on."""
    cut = cut_link(waits, host_of)
    if cut is not None:
        return cut
    waited_on: dict[int, list[int]] = {}
    for rank, peer in waits.items():
        waited_on.setdefault(peer, []).append(rank)
    if waited_on:
        culprit = max(waited_on, key=lambda r: (r not in records, len(waited_on[r])))
        tail = " and left no record" if culprit not in records else ""
        who = _ranges(waited_on[culprit])
        return f"the job stopped at rank {culprit}: rank(s) {who} waited on it{tail}"
    if missing and len(missing) < world:
        return (
            f"the job stopped at rank {_ranges(missing)}: the others waited for it in collectives "
            "and it left no record"
        )
    return ""


def cut_link(waits: dict[int, int], host_of: dict[int, str]) -> str | None:
    """'no rank of node B answered ranks of node A' when every rank of node A that waits on a
    named peer waits on a rank of node B (and at least two of A's ranks do, or all of them);
    both ways when node B's ranks wait on A's alike. None when that is not the pattern."""
    by_host: dict[str, dict[int, str]] = {}
    for rank, peer in waits.items():
        a, b = host_of.get(rank), host_of.get(peer)
        if a is None or b is None:
            continue
        by_host.setdefault(a, {})[rank] = b
    found = {}
    for a, targets in by_host.items():
        others = set(targets.values())
        ranks_of_a = [r for r, h in host_of.items() if h == a]
        if len(others) == 1 and a not in others and (len(targets) >= 2 or len(ranks_of_a) == 1):
            found[a] = others.pop()
    if not found:
        return None
    a, b = sorted(found.items())[0]
    waiting = sorted(r for r, h in by_host[a].items())
    answered = sorted({waits[r] for r in waiting})
    both = found.get(b) == a
    line = (
        f"no rank of node {b} answered ranks of node {a}: rank(s) {_ranges(waiting)} on {a} waited "
        f"on rank(s) {_ranges(answered)} on {b}"
    )
    if both:
        return (
            line
            + f", and {b}'s ranks on {a}'s: the link between {a} and {b} stopped carrying messages"
        )
    return line + f": node {b} stopped, or the link from it"
