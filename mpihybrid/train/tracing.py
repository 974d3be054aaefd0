"""A run's trace: the recorder and its stream, the attributes that say what ran where, the rows
of each step's gradient buckets, and the warning a trace of an oversubscribed host carries.

    recorder, stream = build_trace(job, world, dp_rank, num_actions)   # collective
    begin_trace(job, stream, record, to_run_start, resumed=.., run_started=..)  # rank 0: header
    record_buckets(recorder, step, events, states, ring_peer)          # each step's rings
    trace_step(job, stream, record, step, asked=.., stopping=..)       # the step's metrics
    stream.flush(end_attrs(...), finished=True)                        # at the end

(The trace layer itself, mpihybrid.trace, knows nothing of jobs or schedules: what a run's
attributes are is said here.)
"""

from __future__ import annotations

import logging
import math
import os
import platform
import sys

import numpy as np
from mpi4py import MPI

from mpihybrid import __version__
from mpihybrid.config import Job, to_toml
from mpihybrid.nn.optim import learning_rate
from mpihybrid.sysinfo import clean_text, hostname, mpi_library
from mpihybrid.trace.file import TraceWriter
from mpihybrid.trace.recorder import KIND, Recorder, StepRecorder, StepWindow
from mpihybrid.trace.stream import TraceStream

log = logging.getLogger("mpihybrid")


def build_trace(job: Job, world: MPI.Comm, dp_rank: int, num_actions: int):
    """Collective: the recorder (this rank's events of the traced steps, a buffer for the steps
    between two flushes) and the stream that flushes it; rank 0 also holds the file's writer."""
    tr, t = job.trace, job.train
    recorder_cls = Recorder if tr.events else StepRecorder
    window = StepWindow(tr.first_step, tr.last_step, tr.every)
    # rows per step: the actions plus a few (all-reduce, optimizer, step, the sends' wait)
    held_steps = min(max(t.steps, 1), tr.flush_steps if tr.path and tr.flush_steps else 64)
    recorder = recorder_cls(world.rank, dp_rank, (num_actions + 8) * held_steps, window)
    hosts = world.gather((hostname(), os.cpu_count() or 1), root=0)
    hostnames = [name for name, _ in hosts] if hosts else None
    if world.rank == 0:
        warn_oversubscribed(hosts)
    writer = None
    if tr.path and world.rank == 0:
        attrs = run_attrs(world, job, hostnames)
        attrs["host_cores"] = [cores for _, cores in hosts]  # analysis: oversubscribed or not
        writer = TraceWriter(tr.path, config=to_toml(job), attrs=attrs, overwrite=tr.overwrite)
    stream = TraceStream(
        world, recorder, writer, bool(tr.path), tr.flush_steps, flush_seconds=tr.flush_seconds
    )
    return recorder, stream


_oversubscription_told = False  # warn once per process (a sweep trains many times)


def oversubscribed(hosts: list[tuple[str, int]]) -> str | None:
    """The warning for (hostname, cores) of every rank when a host has more ranks than cores."""
    ranks: dict[str, int] = {}
    cores: dict[str, int] = {}
    for name, n in hosts:
        ranks[name] = ranks.get(name, 0) + 1
        cores[name] = n
    worst = max(ranks, key=lambda h: ranks[h] / cores[h])
    if ranks[worst] <= cores[worst]:
        return None
    return (
        f"oversubscribed: {ranks[worst]} ranks on {worst}, which has {cores[worst]} cores: ranks "
        "wait for a core, so step times and bubbles measure the machine, not the schedule. Run "
        f"at most {cores[worst]} ranks per host (mpiexec -n {cores[worst]} --set grid.pp=P "
        f"--set grid.dp=D with P x D = {cores[worst]}) or read the figures as oversubscribed; "
        "the trace records it."
    )


def warn_oversubscribed(hosts: list[tuple[str, int]]) -> None:
    global _oversubscription_told
    message = oversubscribed(hosts)
    if message and not _oversubscription_told:
        log.warning("%s", message)
        _oversubscription_told = True


def note_ring(world: MPI.Comm, run, notes: dict | None) -> None:
    """Collective: which ring the stages run (comm.ring: two-level where a dp group spans
    nodes) and the caller's notes (train(notes=...)), as trace attributes (rank 0's writer)."""
    two_level = world.allreduce(int(run.gradcomm.groups is not None), op=MPI.MAX)
    if run.trace.writer is not None:
        run.trace.writer.attrs.update(
            {**(notes or {}), "ring": "hierarchical" if two_level else "flat"}
        )


def layout_attrs(job: Job, world_size: int) -> dict:
    """The trace attributes that say how the run was laid out (what analysis reads back); a
    csv: schedule's text goes with them, so its trace is analysed without the file."""
    t, schedule = job.train, job.schedule
    placement = schedule.placement
    return {
        "world_size": world_size,
        "pp": job.grid.pp,
        "dp": job.grid.dp,
        "schedule": t.schedule,
        "microbatches": t.microbatches,
        "virtual_stages": t.virtual_stages,
        "stage_ranks": np.array(placement.stage_ranks, np.int64),  # pp rank of each stage
        "early_grad_send": t.early_grad_send,
        "merge_w": t.merge_w,
        "codec": job.comm.codec,
        "p2p_codec": job.comm.p2p_codec,
        "device": job.grid.device,
        **({"schedule_csv": schedule.csv} if schedule.csv is not None else {}),
        **({"schedule_search": schedule.search} if schedule.search is not None else {}),
        # the vocabulary shares' bucket rows name chunk pp * v + pp_rank (docs/vocab.md)
        **({"vocab_parallel": True} if job.model.vocab_parallel else {}),
    }


def run_attrs(world, job: Job, hostnames: list[str]) -> dict:
    """The trace attributes known at the start (the versions, the layout, each rank's host)."""
    return {
        "mpihybrid_version": __version__,
        "mpi_library": mpi_library(),
        "mpi4py_version": __import__("mpi4py").__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        **layout_attrs(job, world.Get_size()),
        "hostnames": list(hostnames),
        "command": clean_text(" ".join(sys.argv), limit=4096),
    }


def end_attrs(
    runtime_s: float,
    test_accuracy: float,
    peak_rss: list[int] | None,
    probes=None,
    rows: list | None = None,
) -> dict:
    """The trace attributes known only at the end (this part's runtime after a resume; every
    rank's peak resident set over the steps and its core's speed, train.probe; the chunks'
    passes at two row counts, train.row_probe, by rank: None where not timed), on rank 0,
    which writes them."""
    attrs = {"runtime_s": runtime_s, "test_accuracy": test_accuracy}
    if peak_rss is not None:
        attrs["peak_rss_bytes"] = [int(b) for b in peak_rss]
    if probes is not None and all(math.isfinite(x) for x in probes):
        attrs["core_probe_s"] = [float(x) for x in probes]
    timed = [r for r in rows or [] if r is not None]
    chunks = {c: v for _, per in timed for c, v in per.items()}
    if timed and sorted(chunks) == list(range(len(chunks))):
        attrs["row_probe_rows"] = [int(r) for r in timed[0][0]]
        attrs["row_probe_s"] = [float(x) for c in sorted(chunks) for x in chunks[c]]
    return attrs


def begin_trace(
    job: Job, stream: TraceStream, record, to_run_start: float, *, resumed: bool, run_started
) -> None:
    """The trace's first version (rank 0): a resumed run continues the trace at its path, or
    starts one holding the checkpoint's losses (and the schedule's rates) of the earlier steps.
    run_started: the flight records' start of this run (`why` leaves out older records)."""
    rates = [learning_rate(job.train, i) for i in range(record.start)]
    earlier = {"loss": record.losses, "accuracy": record.accuracies, "lr": rates}
    if stream.writer is not None:
        stream.writer.attrs["run_started_at"] = run_started
    stream.begin(to_run_start, record.start if resumed else None, earlier if resumed else None)


def record_buckets(recorder: Recorder, step: int, events, states: dict, ring_peer: int) -> None:
    """Each bucket's ring and update this step (sharded: its weight all-gather, a second ring
    row), as the gradient communication reported them."""
    for ev in events:
        recorder.record(
            KIND["allreduce"],
            step,
            ev.stage,
            ev.bucket,
            ev.start,
            ev.reduced,
            ev.nbytes,
            ring_peer,
        )
        update_start = ev.held or ev.reduced  # a held bucket's update waited for the norm
        recorder.record(KIND["optimizer"], step, ev.stage, ev.bucket, update_start, ev.end)
        if states[ev.stage].reducer.sharded:
            recorder.record(
                KIND["allreduce"],
                step,
                ev.stage,
                ev.bucket,
                ev.end,
                ev.gathered,
                ev.gather_nbytes,
                ring_peer,
            )


# a run without a trace file keeps the rows of its last UNTRACED_STEPS to 2 x UNTRACED_STEPS
# steps for its report (Summary.events), not every step's (1.6 KB a step at hidden 16)
UNTRACED_STEPS = 256


def trace_step(
    job: Job, stream: TraceStream, record, step: int, *, asked: bool, stopping: bool
) -> None:
    """At the step boundary every rank reached: the step's metrics to the trace, and a flush when
    due (never after the last step: the end writes that; always before a preemption's exit)."""
    more = {"grad_norm": record.grad_norm} if job.train.grad_clip else {}
    lr = learning_rate(job.train, step)
    stream.add_step(step, record.losses[-1], record.accuracies[-1], lr=lr, **more)
    last = step == job.train.steps - 1
    if stopping or (not last and stream.due(step, asked)):
        stream.flush(attrs={"stopped_at_step": step + 1} if stopping else None)
    elif not stream.writing and (step + 1) % UNTRACED_STEPS == 0:
        stream.recorder.drop_before(step + 1 - UNTRACED_STEPS)  # memory flat over a long run
