"""The training loop: build the run, then per step: pipeline, ring all-reduce, optimizer, metrics.

    mpiexec -n 12 mpihybrid train jobs/seed_k3_d4.toml --trace runs/seed.h5

Every rank runs train(); rank 0 gathers metrics, the trace and the report. What a run is built
from is train.build (its chunks as train.state.StageState), what it records train.summary, its
evaluations train.evaluate, its trace train.tracing, the step line train.report.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np
from mpi4py import MPI

from mpihybrid import _numba
from mpihybrid.comm.device import Backend, keep_freed_host_memory, select_backend
from mpihybrid.config import Job
from mpihybrid.nn.data import replica_microbatches
from mpihybrid.nn.optim import learning_rate
from mpihybrid.trace.recorder import KIND, Recorder, clock_offset
from mpihybrid.train import build, checkpoint, clip, evaluate, report, row_probe, tracing
from mpihybrid.train.build import Run
from mpihybrid.train.flight import FlightRecorder, record_dir, run_id
from mpihybrid.train.memory import peak_rss_bytes
from mpihybrid.train.probe import CoreProbe
from mpihybrid.train.state import nonfinite_stages
from mpihybrid.train.stops import (
    StopRequested,
    TrainingStopped,
    agreed_stop,
    signal_counts,
    stop_exception,
    stop_nonfinite,
)
from mpihybrid.train.summary import (
    Record,
    Summary,
    bytes_sent,
    gather_parameters,
    last_grid,
    replica_check,
)
from mpihybrid.train.watchdog import StopSignals, Watchdog

log = logging.getLogger("mpihybrid")


def train(
    job: Job,
    world: MPI.Comm,
    quiet: bool = False,
    collect_params: bool = False,
    resume_from: str | list[str] | None = None,
    *,
    backend: Backend | None = None,
    peak_flops: float | None = None,
    notes: dict | None = None,
    calibrating: bool = False,
) -> Summary | None:
    """Run the job on every rank of `world`; rank 0 gets the Summary, the others None.

    notes: more trace attributes (strings) from the caller, e.g. how grid.order = auto was
    resolved (predict.auto: `order_choice`).

    calibrating: auto's steps before the job's own: the job's stop handling (its checkpoint.dir
    decides what SIGTERM/SIGUSR1 mean), no checkpoint written, a stop raised as before step 1.

    peak_flops: one rank's GEMM rate (FLOP/s, e.g. the local cluster file's), for the roofline
    share in the step line (train.log_every); None leaves it out.

    resume_from: complete checkpoint directories to continue from, newest first (or one): the
    newest intact one is loaded (checkpoint.restore_all).
    Raises a StopRequested on every rank alike at an agreed step boundary: Preempted after
    writing a checkpoint when a rank got SIGUSR1/SIGTERM, Interrupted (SIGINT), Terminated
    (SIGTERM without a checkpoint.dir), TrainingStopped when the run cannot go on (a non-finite
    loss or gradient, a checkpoint the file system refused). A rank that cannot reach that
    boundary, or makes no progress for comm.timeout_s, ends the job (train.watchdog). Any other
    exception carries `.step`, the step (from 1) this rank was in, for the one line the CLI
    prints; every abnormal end writes this rank's flight record.

    collect_params: also bring replica 0's final parameters of every stage to rank 0
    (Summary.params, in stage order) -- what the equivalence tests compare.

    backend: where arrays live; None selects it from grid.device (collective; DeviceError on
    every rank alike when that fails).
    """
    keep_freed_host_memory()  # numpy's temporaries reuse memory instead of page-faulting it in
    if backend is None:
        backend = select_backend(job.grid.device, job.comm.cuda_aware, world)
    if backend.xp is not np and not quiet:
        log.info("rank %d: %s", world.rank, backend.describe())  # which GPU, which MPI path
    signals, flight, flight_dir, dog = _watch(job, world)
    run, record = None, Record(calibrating=calibrating)
    try:
        i = flight.begin("build")
        run = build.build_run(job, world, backend)
        tracing.note_ring(world, run, notes)
        flight.pp_rank, flight.dp_rank = run.grid.pp_rank, run.grid.dp_rank
        run.flight, run.signals, run.watchdog, run.peak_flops = flight, signals, dog, peak_flops
        run.runtime.flight = flight
        if resume_from is not None:
            record.start, record.losses, record.accuracies = checkpoint.restore_all(
                world, job, resume_from, run.states, dp_rank=run.grid.dp_rank
            )
        flight.end(i)
        _stop_before_training(job, world, run, record)
        record.peak_inflight = dict.fromkeys(run.states, 0)
        summary = _steps(
            job,
            world,
            run,
            record,
            quiet=quiet,
            collect=collect_params,
            resumed=resume_from is not None,
        )
    except BaseException as exc:
        dog.settle()
        _keep_flight_record(job, flight, flight_dir, exc)
        if isinstance(exc, StopRequested) and run is not None:
            run.release()  # every rank stopped at the same boundary: collectives are safe
        raise
    finally:
        dog.stop()
    if summary is not None:
        summary.start = record.start
    return summary


def _watch(job: Job, world: MPI.Comm):
    """What watches a run, made before it is built: the stop-signal handlers (the CLI installs
    them before MPI starts: a signal that comes while the model is built still counts; they stay
    until the process exits), this rank's flight record and where it goes, the stall watchdog."""
    main_thread = threading.current_thread() is threading.main_thread()
    signals = StopSignals.install() if main_thread else None
    name, started = world.bcast((run_id(), time.time()), root=0)  # one run, one name and start
    flight = FlightRecorder(world.rank, world_size=world.Get_size(), run_started=started)
    flight_dir = record_dir(job.trace.path, job.checkpoint.dir, name)
    dog = Watchdog(
        flight,
        signals,
        job.comm.timeout_s,
        world.Abort,
        lambda: flight_dir,
        usr1_stops=bool(job.checkpoint.dir),
    ).start()
    return signals, flight, flight_dir, dog


def _steps(
    job: Job,
    world: MPI.Comm,
    run: Run,
    record: Record,
    *,
    quiet: bool,
    collect: bool,
    resumed: bool,
) -> Summary | None:
    """Every step from record.start, then the end's collectives (rank 0: the Summary)."""
    # the core's speed, for whatif and the stragglers (the live line scores replicas)
    live = job.grid.dp > 1 and job.train.log_every
    if (run.trace.writing or live) and run.backend.xp is np:
        record.probe = CoreProbe(run.runtime.slow)  # a slower device (train.slowdown D) too
    offset = clock_offset(world)
    if not quiet and world.rank == 0 and _numba.ENABLED and not _numba.kernels_cached():
        log.info("compiling kernels (numba): the first step takes a while; cached after it")
    world.Barrier()
    t_start = Recorder.clock()
    record.log_from = (record.start, t_start, 0.0)
    # Rank 0's clock at the start, for traces relative to the run's start.
    t_origin = world.bcast(t_start + offset if world.rank == 0 else None, root=0)
    tracing.begin_trace(
        job,
        run.trace,
        record,
        offset - t_origin,
        resumed=resumed,
        run_started=run.flight.run_started,
    )
    run.watchdog.at_boundary()
    if run.tie is not None:  # the head's mirror starts as the table (drawn, loaded or resumed)
        run.tie.refresh()
    # overflow and nan are checked once per step (the loss, each gradient): no numpy warnings
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for step in range(record.start, job.train.steps):
            try:
                _train_step(job, world, run, record, step, quiet=quiet)
            except StopRequested:
                raise
            except BaseException as exc:  # SystemExit and KeyboardInterrupt on one rank too
                exc.step = step + 1  # for the one line the CLI prints
                raise
    run.watchdog.settle()  # the steps are done: a signal now is absorbed, the end is written
    runtime_s = Recorder.clock() - t_start - record.held_out.seconds  # the steps, not evals
    record.peak_rss = peak_rss_bytes()  # the steps' peak, before evaluation allocates its own
    return _finish(job, world, run, record, runtime_s=runtime_s, collect=collect)


def _keep_flight_record(job: Job, flight, flight_dir, exc: BaseException) -> None:
    """This rank's flight record of an abnormal end. An untraced run (no trace, no checkpoint.dir)
    keeps none of an agreed stop (every rank at a boundary: nothing for `why` to tell, nothing
    left in the temporary directory); of an error it keeps it there, and the error's one line
    names it (exc.flight_record)."""
    untraced = not (job.trace.path or job.checkpoint.dir)
    if untraced and isinstance(exc, StopRequested):
        return
    path = flight.write(flight_dir, _ended_by(exc))
    if untraced and path is not None:
        try:
            exc.flight_record = path
        except AttributeError:  # an exception type without attributes: the line stays bare
            pass


def _ended_by(exc: BaseException) -> str:
    """The flight record's reason for an abnormal end."""
    if isinstance(exc, StopRequested):
        return str(exc)
    return f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _train_step(job: Job, world: MPI.Comm, run: Run, record: Record, step: int, *, quiet: bool):
    """One step on this rank: pipeline, all-reduce, optimizer, metrics; a checkpoint when due
    (and a StopRequested after it when a rank was told to stop)."""
    t = job.train
    grid, backend = run.grid, run.backend
    t_step = Recorder.clock()
    lr = learning_rate(t, step)
    for st in run.states.values():
        st.begin_step(lr)  # gradients zeroed; a reduced bucket updates its slice of the weights
    batches = replica_microbatches(
        run.task, step, t.global_batch, grid.dp_rank, grid.dp_size, num_microbatches=t.microbatches
    )
    if backend.xp is not np:
        batches = [(backend.asarray(bx), backend.asarray(by)) for bx, by in batches]
    result = run.runtime.run_step(step, batches)
    if run.tie is not None:  # the head's gradient into the table's, before the table's ring
        k = run.flight.begin("tied embedding: gradient", step + 1)  # a wait the watchdog names
        run.tie.sum_grads()
        run.flight.end(k)
    # the rest of the buckets: most were reduced and applied behind the pipeline's compute; the
    # ring waits on its predecessor most directly (with dp = 1 there is no ring)
    source = grid.replica_neighbour(-1) if grid.dp_size > 1 else -1
    i = run.flight.begin("grad_wait", step + 1, peer=source)
    t0 = Recorder.clock()
    events = run.gradcomm.finish()
    bad = None  # the stages whose gradient is not finite (None: not known yet)
    if t.grad_clip:  # the grad_wait row covers the norm and the held updates too
        bad = _clip_and_update(world, run, record, events, t.grad_clip)
    run.recorder.record(KIND["grad_wait"], step, -1, -1, t0, Recorder.clock())
    if run.tie is not None:  # the head's mirror is the updated table
        k = run.flight.begin("tied embedding: table", step + 1)
        run.tie.refresh()
        run.flight.end(k)
    tracing.record_buckets(run.recorder, step, events, run.states, run.ring_peer)
    run.flight.end(i)
    run.recorder.record(KIND["step"], step, -1, -1, t_step, Recorder.clock())
    for s, n in result.peak_inflight.items():
        record.peak_inflight[s] = max(record.peak_inflight[s], n)
    _step_boundary(job, world, run, record, step, result=result, quiet=quiet, bad=bad)


def _clip_and_update(world, run: Run, record: Record, events: list, grad_clip: float):
    """train.grad_clip: the global norm (collective, from the sums of squares the buckets took
    as their rings ended), each optimizer told the clip coefficient; then every held bucket's
    update (and sharded, its weight gather), in stage and bucket order on every replica; the
    events carry the updates' own times. Returns the stages whose gradient is not finite."""
    reducers = {s: st.reducer for s, st in run.states.items()}
    record.grad_norm, bad = clip.global_norm(world, reducers)
    record.grad_norms.append(record.grad_norm)
    coef = clip.clip_coefficient(record.grad_norm, grad_clip)
    for st in run.states.values():
        st.optimizer.scale_gradients(coef)
    by_bucket = {(ev.stage, ev.bucket): ev for ev in events}
    for s in sorted(reducers):
        for i in range(len(reducers[s].buckets)):
            ev = by_bucket[(s, i)]
            ev.held = Recorder.clock()  # the optimizer row starts here, not at the ring's end
            ev.end, ev.gathered, ev.gather_nbytes = reducers[s].release(i)
    return bad


def _step_boundary(
    job: Job,
    world: MPI.Comm,
    run: Run,
    record: Record,
    step: int,
    *,
    result,
    quiet: bool,
    bad: list[int] | None,
) -> None:
    """The step's end, agreed by every rank: one small collective carries the metrics, whether
    any rank was told to stop and whether any gradient is not finite (agreed here, never inside
    a handler; `bad`: the stages the clip's norm found not finite, None: look); then the trace,
    the step line, the held-out loss, a checkpoint when due."""
    t = job.train
    bad = nonfinite_stages(run.stages) if bad is None else bad
    mine = np.array(
        [
            result.loss_sum,
            result.correct,
            result.samples,
            run.trace.asks(),
            len(bad),
            *signal_counts(run.signals),
        ]
    )
    sums = np.empty_like(mine)
    i = run.flight.begin("metrics allreduce", step + 1)
    world.Allreduce(mine, sums, op=MPI.SUM)
    run.flight.end(i)
    run.watchdog.at_boundary()
    if record.probe is not None:  # every rank at once, as all run at once in the step
        record.probe.tick()
    record.losses.append(float(sums[0] / (job.grid.dp * t.microbatches)))
    record.accuracies.append(float(sums[1] / max(sums[2], 1)))
    finite = bool(np.isfinite(sums[0])) and not sums[4]
    stop = agreed_stop(job, sums[5:])
    stopping = stop is not None or not finite
    if stopping:
        run.watchdog.settle()
    tracing.trace_step(job, run.trace, record, step, asked=sums[3] > 0, stopping=stopping)
    line_due = t.log_every and ((step + 1) % t.log_every == 0 or step == t.steps - 1)
    if line_due and job.grid.dp > 1:  # collective: the live straggler line (rank 0)
        record.stragglers.observe(world, run.runtime, run.grid.pp_rank, record.probe)
    if not quiet and line_due:
        report.log_step(  # collective: the peak memory over the ranks
            job,
            world,
            record,
            step,
            held_out_s=record.held_out.seconds,
            peak_flops=run.peak_flops,
        )
    if not finite:  # before any checkpoint: never one of these weights
        stop_nonfinite(world, job, step, float(sums[0]), bad)
    if record.held_out.due(job, step):
        i = run.flight.begin("held-out loss", step + 1)
        record.held_out.after_step(job, world, run, step, quiet)
        run.flight.end(i)
    if sums[5] and not job.checkpoint.dir and not record.usr1_warned:
        record.usr1_warned = True
        if world.rank == 0:
            log.warning(
                "preemption signal received but checkpoint.dir is not set: cannot "
                "checkpoint; training goes on until it ends or is killed"
            )
    every = job.checkpoint.every
    path = None
    if not record.calibrating and (stop == "preempt" or (every and (step + 1) % every == 0)):
        path = _save_checkpoint(job, world, run, record, step)
    if stop is not None:  # a calibration's steps are none of the job's: it stops before step 1
        raise stop_exception(stop, 0 if record.calibrating else step + 1, path)


def _save_checkpoint(job: Job, world: MPI.Comm, run: Run, record: Record, step: int) -> str:
    """Collective: every rank's part of the checkpoint after `step` (0-based)."""
    i = run.flight.begin("checkpoint", step + 1)
    try:
        path = checkpoint.save_all(
            world,
            job,
            run.states,
            dp_rank=run.grid.dp_rank,
            step=step + 1,
            losses=record.losses,
            accuracies=record.accuracies,
        )
    except checkpoint.CheckpointError as exc:  # every rank alike
        raise TrainingStopped(step + 1, str(exc)) from None
    run.flight.end(i)
    return path


def _stop_before_training(job: Job, world: MPI.Comm, run: Run, record: Record) -> None:
    """Collective, once the model is built: a stop signal that came during start-up ends the run
    now, before any step (nothing new to checkpoint)."""
    counts = np.array(signal_counts(run.signals))
    world.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    stop = agreed_stop(job, counts)
    if stop is not None:
        run.watchdog.settle()
        raise stop_exception(stop, record.start, None)


def _finish(
    job: Job, world: MPI.Comm, run: Run, record: Record, *, runtime_s: float, collect: bool
) -> Summary | None:
    """Collectives after the last step (evaluation, replica check, bytes, the trace's last
    flush), then rank 0 builds the Summary."""
    t, flight = job.train, run.flight
    placement = run.runtime.placement
    i = flight.begin("evaluate")
    test_accuracy = evaluate.heldout_accuracy(world, job, run)
    flight.end(i)
    i = flight.begin("replica check")
    replica_diff = replica_check(world, run.grid, run.stages)
    sent = bytes_sent(world, run.runtime, run.states)
    peaks = world.gather(record.peak_inflight, root=0)
    probe = record.probe.median() if record.probe else math.nan
    flight.end(i)
    i = flight.begin("row probe")
    timed_rows = None  # how this host's passes scale with the rows (whatif's change of M)
    if record.probe is not None and run.trace.writing and run.grid.dp_rank == 0:
        work = job.workload  # the model's chunks; a vocab_parallel run's shares are not timed
        timed_rows = row_probe.time_rows(work, [c for c in sorted(run.stages) if c < work.chunks])
    flight.end(i)
    ends = world.gather((record.peak_rss, probe, timed_rows), root=0)  # None but on rank 0
    peak_rss, probes, rows = ([end[i] for end in ends] for i in (0, 1, 2)) if ends else [None] * 3
    _checkpoint_if_signalled(job, world, run, record)
    # the rows since the last flush (every row when no trace file is written), on rank 0
    i = flight.begin("trace flush")
    end = tracing.end_attrs(runtime_s, test_accuracy, peak_rss, probes, rows)
    events = run.trace.flush(end, finished=True)
    flight.end(i)
    run.release()
    stages = run.stages
    chunks = placement.num_stages + len(run.shards and range(run.grid.pp_size))  # + the shares
    params = gather_parameters(world, run.grid, stages, chunks) if collect else None
    if world.rank != 0:
        return None
    ran = t.steps - record.start
    return Summary(
        steps=t.steps,
        runtime_s=runtime_s,
        samples_per_s=ran * t.global_batch / runtime_s if runtime_s > 0 else 0.0,
        losses=record.losses.kept(),
        accuracies=record.accuracies.kept(),
        test_accuracy=test_accuracy,
        bytes_sent=sent,
        replica_max_diff=replica_diff,
        peak_inflight=dict(sorted({s: n for d in peaks for s, n in d.items()}.items())),
        grid_as_run=last_grid(events, placement, t.steps - 1) if ran > 0 else "",
        params=params,
        events=events,
        trace_path=job.trace.path,
        peak_rss_bytes=peak_rss,
        evals=record.held_out.evals,
        extra={"grad_norms": record.grad_norms} if t.grad_clip else {},
    )


def _checkpoint_if_signalled(job: Job, world: MPI.Comm, run: Run, record: Record) -> None:
    """Collective: a preemption signal that came after the last step's boundary still gets the
    final checkpoint (when there is a checkpoint.dir and the last step has none); the run then
    finishes its report and trace and exits 0, since nothing is left to requeue."""
    counts = np.array(signal_counts(run.signals))
    world.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    usr1, term, _ = counts
    every, steps = job.checkpoint.every, job.train.steps
    if not (usr1 or term) or steps == record.start or record.calibrating:
        return  # a calibration's: the signal stays counted, the job stops before its step 1
    saved = ""
    if job.checkpoint.dir and not (every and steps % every == 0):
        path = _save_checkpoint(job, world, run, record, steps - 1)
        saved = f"; final checkpoint written to {path}"
    if world.rank == 0:
        log.warning("a stop signal came after the last step: the run finishes%s", saved)
