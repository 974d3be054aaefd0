"""Exports of a trace: Chrome trace-event JSON (Perfetto, chrome://tracing) and CSV.

    mpihybrid export runs/seed.h5 --format chrome -o runs/seed.json   # open in ui.perfetto.dev

Chrome format: one process per rank (pid = world rank), "X" complete events with ts/dur in
microseconds, and a flow arrow ("s" -> "f") from every send, where it was posted, to the receive
it fed, where that receive completed; the critical path of each step (analysis/critical.py) as
slices on a thread of its own per rank ("critical path"), chained by flow events (category
"critical") from each link to the next. Steps are counted from 1 in both formats, as every command
shows them; `steps` (a range of the trace's own numbers, from 0) exports a window.
"""

from __future__ import annotations

import csv
import io
import json
import os

import numpy as np

from mpihybrid.analysis.messages import match_messages
from mpihybrid.files import write_atomic
from mpihybrid.trace.read import Trace
from mpihybrid.trace.recorder import COMPUTE, KIND, KINDS, VOCAB

# tid 0 carries the main thread's work (compute, messages, the wait for the gradients), tid 1
# the whole steps, tid 2 the gradient buckets (ring, then optimizer), which may run behind the
# compute: complete events on one thread must nest, and a step encloses everything its rank did
WORK_TID, STEP_TID, BUCKET_TID, CRITICAL_TID = 0, 1, 2, 3
_TID = {KIND["step"]: STEP_TID, KIND["allreduce"]: BUCKET_TID, KIND["optimizer"]: BUCKET_TID}
CSV_COLUMNS = (
    "rank",
    "stage",
    "replica",
    "kind",
    "step",
    "microbatch",
    "start",
    "end",
    "duration",
    "bytes",
    "peer",
)


def event_name(e: np.void, direction: str | None = None, chunks: bool = False) -> str:
    """ "F3" (or "1F3" with several chunks per rank), "S3" (a vocabulary pass), "send F3",
    "recv B2", "allreduce s1" ..."""
    kind, stage, mb = int(e["kind"]), int(e["stage"]), int(e["microbatch"])
    if kind in COMPUTE:
        return f"{stage if chunks else ''}{COMPUTE[kind]}{mb}"
    if kind in VOCAB:  # model.vocab_parallel's pass of the rank's share: "S3"
        return f"{VOCAB[kind]}{mb}"
    name = KINDS[kind]
    if name in ("send", "recv"):
        if mb < 0:
            return f"{name} wait"  # waiting for a step's outstanding sends
        return f"{name} {direction or ''}{mb}"
    if name in ("allreduce", "optimizer"):
        return f"{name} s{stage}" + (f" bucket {mb}" if mb >= 0 else "")
    return f"{name} {int(e['step']) + 1}"  # steps shown from 1, as the progress line counts


def window(trace: Trace, steps: range | None) -> Trace:
    """The trace's rows of `steps` only (None: all of them)."""
    if steps is None:
        return trace
    ev = trace.events
    kept = ev[(ev["step"] >= steps.start) & (ev["step"] < steps.stop)]
    return Trace(events=kept, steps=trace.steps, config=trace.config, attrs=trace.attrs)


def to_chrome(trace: Trace) -> dict:
    """The trace as a Chrome trace-event document ({"traceEvents": [...], ...})."""
    ev = trace.events
    chunks = int(trace.attrs.get("virtual_stages", 1)) > 1
    messages = match_messages(ev)
    # which way each matched send and recv row went, for names like "send F3"
    direction = dict(zip(messages.send.tolist(), messages.direction.tolist(), strict=True))
    direction |= dict(zip(messages.recv.tolist(), messages.direction.tolist(), strict=True))
    out: list[dict] = []
    for rank in np.unique(ev["rank"]):
        rows = ev[ev["rank"] == rank]
        stages = sorted({int(s) for s in rows["stage"] if s >= 0})
        label = f"rank {rank} (stage {','.join(map(str, stages))}, dp {rows['replica'][0]})"
        pid = int(rank)
        meta = {"ph": "M", "pid": pid}
        out += [
            meta | {"name": "process_name", "args": {"name": label}},
            meta | {"name": "process_sort_index", "args": {"sort_index": pid}},
            meta | {"tid": WORK_TID, "name": "thread_name", "args": {"name": "work"}},
            meta | {"tid": STEP_TID, "name": "thread_name", "args": {"name": "step"}},
            meta | {"tid": BUCKET_TID, "name": "thread_name", "args": {"name": "gradient buckets"}},
            meta | {"tid": CRITICAL_TID, "name": "thread_name", "args": {"name": "critical path"}},
        ]
    for i, e in enumerate(ev):
        args = {
            "step": int(e["step"]) + 1,  # from 1, as every command shows steps
            "stage": int(e["stage"]),
            "microbatch": int(e["microbatch"]),
            "bytes": int(e["bytes"]),
            "peer": int(e["peer"]),
        }
        out.append(
            {
                "ph": "X",
                "name": event_name(e, direction.get(i), chunks),
                "cat": KINDS[int(e["kind"])],
                "pid": int(e["rank"]),
                "tid": _TID.get(int(e["kind"]), WORK_TID),
                "ts": float(e["start"]) * 1e6,
                "dur": float(e["end"] - e["start"]) * 1e6,
                "args": args,
            }
        )
    for k, (i, j) in enumerate(zip(messages.send, messages.recv, strict=True)):
        s, r = ev[i], ev[j]
        # from where the send was posted to where its receive completed (the data has arrived),
        # each end just inside its slice so the viewer binds it to that slice
        flow = {"name": "activation" if messages.direction[k] == "F" else "gradient"}
        flow |= {"cat": "p2p", "id": k, "tid": WORK_TID}
        out.append(flow | {"ph": "s", "pid": int(s["rank"]), "ts": _inside(s, at_end=False)})
        out.append(flow | {"ph": "f", "bp": "e", "pid": int(r["rank"]), "ts": _inside(r, True)})
    out += critical_events(trace, first_id=len(messages))
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {
            name: trace.attrs[name]
            for name in ("schedule", "pp", "dp", "microbatches", "virtual_stages", "codec")
            if name in trace.attrs
        },
    }


def critical_events(trace: Trace, first_id: int = 0) -> list[dict]:
    """Each step's critical path: a slice per link on its rank's "critical path" thread (a hop
    on the receiver's), and a flow from each link to the next, so the viewer draws the chain
    across the ranks. None for a trace without per-action events."""
    from mpihybrid.analysis.critical import critical_paths
    from mpihybrid.analysis.lanes import Lanes, LanesError

    try:
        paths = critical_paths(Lanes.of(trace.events))
    except LanesError:
        return []
    out: list[dict] = []
    flow_id = first_id
    for path in paths:
        links = [k for k in path.links if k.seconds > 0]
        for n, link in enumerate(links):
            ts, dur = link.start * 1e6, link.seconds * 1e6
            name = link.text().rsplit(" ", 2)[0]  # without its duration
            where = {"pid": link.rank, "tid": CRITICAL_TID}
            out.append(
                where | {"ph": "X", "name": name, "cat": "critical", "ts": ts, "dur": dur,
                         "args": {"step": path.step + 1, "link": link.label()}}
            )  # fmt: skip
            if n + 1 < len(links):
                nxt = links[n + 1]
                margin = min(1e-3, dur / 2, nxt.seconds * 1e6 / 2)
                flow = {"name": "critical path", "cat": "critical", "id": flow_id}
                out.append(flow | where | {"ph": "s", "ts": ts + dur - margin})
                out.append(flow | {"ph": "f", "bp": "e", "pid": nxt.rank, "tid": CRITICAL_TID,
                                   "ts": nxt.start * 1e6 + margin})  # fmt: skip
                flow_id += 1
    return out


def _inside(e: np.void, at_end: bool) -> float:
    """Microseconds just inside the slice of `e`: by 1 ns (or half the slice, if shorter) from
    its end or its start."""
    start, end = float(e["start"]) * 1e6, float(e["end"]) * 1e6
    margin = min(1e-3, (end - start) / 2)
    return end - margin if at_end else start + margin


def to_csv(trace: Trace) -> str:
    """One row per event with a header; kind as its name, steps from 1, times in seconds."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for e in trace.events:
        start, end = float(e["start"]), float(e["end"])
        writer.writerow(
            [
                int(e["rank"]),
                int(e["stage"]),
                int(e["replica"]),
                KINDS[int(e["kind"])],
                int(e["step"]) + 1,
                int(e["microbatch"]),
                repr(start),
                repr(end),
                repr(end - start),
                int(e["bytes"]),
                int(e["peer"]),
            ]
        )
    return buf.getvalue()


def export(
    trace: Trace,
    path: str | os.PathLike,
    fmt: str,
    overwrite: bool = False,
    steps: range | None = None,
) -> None:
    """Write the trace (its `steps` only, if given) as `fmt` ("chrome" or "csv") to `path`,
    atomically."""
    trace = window(trace, steps)
    if fmt == "chrome":
        data = json.dumps(to_chrome(trace), separators=(",", ":"))
    elif fmt == "csv":
        data = to_csv(trace)
    else:
        raise ValueError(f"unknown export format {fmt!r}; choose chrome or csv")
    write_atomic(path, data, overwrite)
