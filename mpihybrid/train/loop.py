"""The training loop: grid, stages, schedule, then per step: pipeline, ring all-reduce, optimizer.

    mpiexec -n 12 mpihybrid train jobs/seed_k3_d4.toml --trace runs/seed.h5

Every rank runs this function; rank 0 gathers metrics, the trace and the report.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpihybrid import __version__, _numba
from mpihybrid.comm.buckets import GradientComm, ring_kind
from mpihybrid.comm.codecs import get_codec, overflow_hint
from mpihybrid.comm.device import (
    Backend,
    host_array,
    keep_freed_host_memory,
    select_backend,
)
from mpihybrid.comm.grid import ProcessGrid
from mpihybrid.comm.hier_ring import NodeGroups
from mpihybrid.comm.nodes import NodeMapError, node_map
from mpihybrid.config import ConfigError, Job, to_toml
from mpihybrid.nn.data import build_task, heldout, replica_microbatches, task_dims
from mpihybrid.nn.model import block_costs, boundary_shapes, build_blocks, build_stage
from mpihybrid.nn.optim import ShardedOptimizer, build_optimizer, learning_rate
from mpihybrid.nn.weights import load_into
from mpihybrid.pipeline.as_run import grid_as_run
from mpihybrid.pipeline.csv_schedule import csv_text
from mpihybrid.pipeline.runtime import PipelineRuntime, forward_only
from mpihybrid.pipeline.schedules import build_schedule, lower, placement_of
from mpihybrid.pipeline.search import search_attrs
from mpihybrid.pipeline.wire import P2PWire, encoded_peers
from mpihybrid.sysinfo import clean_text, hostname, mpi_library
from mpihybrid.trace.file import TraceWriter
from mpihybrid.trace.recorder import (
    KIND,
    Recorder,
    StepRecorder,
    StepWindow,
    clock_offset,
)
from mpihybrid.trace.stream import TraceStream
from mpihybrid.train import checkpoint, clip
from mpihybrid.train.flight import FlightRecorder, record_dir, run_id
from mpihybrid.train.history import History
from mpihybrid.train.memory import peak_rss_bytes
from mpihybrid.train.stops import (
    StopRequested,
    TrainingStopped,
    agreed_stop,
    signal_counts,
    stop_exception,
)
from mpihybrid.train.watchdog import StopSignals, Watchdog
from mpihybrid.units import human_bytes

log = logging.getLogger("mpihybrid")


@dataclass
class Summary:
    """What rank 0 reports at the end (other ranks get None from train())."""

    steps: int
    runtime_s: float
    samples_per_s: float
    losses: list[float]
    accuracies: list[float]
    test_accuracy: float
    bytes_sent: dict[str, int]
    replica_max_diff: dict[int, float]  # stage -> max |w - w_replica0| over replicas
    peak_inflight: dict[int, int]
    grid_as_run: str
    trace_path: str = ""
    params: list[np.ndarray] | None = None
    # every rank's trace events since the trace's last flush (when the run writes no trace file:
    # those of its last UNTRACED_STEPS steps or more), rank 0's clock, run start = 0
    events: np.ndarray | None = None
    extra: dict = field(default_factory=dict)
    start: int = 0  # the step this run began at (a resumed run ran steps - start of them)
    # every rank's peak resident set over the training steps (before evaluation), rank order
    peak_rss_bytes: list[int] | None = None
    # held-out loss every train.eval_every steps: {"step" (from 1), "loss" (nats per token),
    # "bits_per_token", "bits_per_byte" (nan unless a token is a byte), "perplexity"}
    evals: list[dict] = field(default_factory=list)


def train(
    job: Job,
    world: MPI.Comm,
    quiet: bool = False,
    collect_params: bool = False,
    resume_from: str | list[str] | None = None,
    backend: Backend | None = None,
    peak_flops: float | None = None,
    *,
    notes: dict | None = None,
) -> Summary | None:
    """Run the job on every rank of `world`; rank 0 gets the Summary, the others None.

    notes: more trace attributes (strings) from the caller, e.g. how grid.order = auto was
    resolved (predict.auto: `order_choice`).

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
    # the handlers first (the CLI installs them before MPI starts): a signal that comes while the
    # model is built still counts; they stay until the process exits
    main_thread = threading.current_thread() is threading.main_thread()
    signals = StopSignals.install() if main_thread else None
    name, started = world.bcast((run_id(), time.time()), root=0)  # one run, one name and start
    flight = FlightRecorder(world.rank, world_size=world.Get_size(), run_started=started)
    flight_dir = record_dir(job.trace.path, job.checkpoint.dir, name)
    dog = Watchdog(
        flight, signals, job.comm.timeout_s, world.Abort, lambda: flight_dir,
        usr1_stops=bool(job.checkpoint.dir),
    ).start()  # fmt: skip
    run = None
    try:
        i = flight.begin("build")
        run = _build(job, world, backend)
        # which ring the stages run (comm.ring: two-level where a dp group spans nodes)
        two_level = world.allreduce(int(run.gradcomm.groups is not None), op=MPI.MAX)
        if run.trace is not None and run.trace.writer is not None:
            run.trace.writer.attrs.update(
                {**(notes or {}), "ring": "hierarchical" if two_level else "flat"}
            )
        flight.pp_rank, flight.dp_rank = run.grid.pp_rank, run.grid.dp_rank
        run.flight, run.signals, run.watchdog = flight, signals, dog
        run.runtime.flight = flight
        if resume_from is not None:
            run.start, run.losses, run.accuracies = checkpoint.restore_all(
                world, run.grid.dp_rank, job, resume_from, run.stages, run.optimizers, run.rings
            )
        flight.end(i)
        _stop_before_training(job, world, run)

        offset = clock_offset(world)
        run.peak_flops = peak_flops
        if not quiet and world.rank == 0 and _numba.ENABLED and not _numba.kernels_cached():
            log.info("compiling kernels (numba): the first step takes a while; cached after it")
        world.Barrier()
        t_start = Recorder.clock()
        run.log_from = (run.start, t_start, 0.0)
        # Rank 0's clock at the start, for traces relative to the run's start.
        t_origin = world.bcast(t_start + offset if world.rank == 0 else None, root=0)
        _begin_trace(job, run, offset - t_origin, resumed=resume_from is not None)
        dog.at_boundary()
        # overflow and nan are checked once per step (the loss, each gradient): no numpy warnings
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for step in range(run.start, job.train.steps):
                try:
                    _train_step(job, world, run, step, quiet)
                except StopRequested:
                    raise
                except BaseException as exc:  # SystemExit and KeyboardInterrupt on one rank too
                    exc.step = step + 1  # for the one line the CLI prints
                    raise
        dog.settle()  # the steps are done: a signal now is absorbed, the end is written
        runtime_s = Recorder.clock() - t_start - run.eval_s  # the steps, not the evaluations
        run.peak_rss = peak_rss_bytes()  # the steps' peak, before evaluation allocates its own
        summary = _finish(job, world, run, runtime_s, collect_params)
    except BaseException as exc:
        dog.settle()
        flight.write(flight_dir, _ended_by(exc))
        if isinstance(exc, StopRequested) and run is not None:
            _release(run)  # every rank stopped at the same boundary: collectives are safe
        raise
    finally:
        dog.stop()
    if summary is not None:
        summary.start = run.start
    return summary


def _ended_by(exc: BaseException) -> str:
    """The flight record's reason for an abnormal end."""
    if isinstance(exc, StopRequested):
        return str(exc)
    return f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


@dataclass
class _Run:
    """What train() builds once on a rank and every step uses."""

    grid: ProcessGrid
    task: object
    backend: Backend
    stages: dict  # global stage -> Stage, the chunks this rank owns
    recorder: Recorder
    runtime: PipelineRuntime
    gradcomm: GradientComm  # the gradient buckets of every stage and how they make progress
    rings: dict  # stage -> its buckets.Reducer (the buckets' rings, the residual)
    optimizers: dict
    ring_peer: int  # world rank the ring sends to (the trace's peer of an all-reduce)
    start: int = 0  # first step to run (after a resume, the checkpoint's)
    losses: History = field(default_factory=History)  # by step, in a fixed ring
    accuracies: History = field(default_factory=History)
    peak_inflight: dict = field(default_factory=dict)
    trace: TraceStream | None = None  # flushes the recorder's rows to the trace file as it goes
    peak_rss: int = 0  # this rank's peak resident set at the end of the training steps
    evals: list = field(default_factory=list)  # held-out losses so far (heldout_loss)
    eval_set: tuple | None = None  # my replica's held-out samples (read at the first eval)
    eval_s: float = 0.0  # seconds spent in held-out evaluations (left out of the runtime)
    # the step line counts from (step, rank 0's clock, eval_s) of the line before
    log_from: tuple[int, float, float] = (0, 0.0, 0.0)
    peak_flops: float | None = None  # one rank's GEMM rate, for the step line's roofline %
    usr1_warned: bool = False  # said once: SIGUSR1 came but there is no checkpoint.dir
    flight: FlightRecorder | None = None  # this rank's last actions and waits
    signals: StopSignals | None = None  # None: not the main thread (no signal handlers)
    watchdog: Watchdog | None = None
    world: MPI.Comm | None = None
    grad_clip: float = 0.0  # train.grad_clip: the buckets are held, updated after the norm
    grad_norm: float = math.nan  # the last step's global gradient norm (with grad_clip)
    grad_norms: list = field(default_factory=list)  # every step's of this run


def _build(job: Job, world: MPI.Comm, backend: Backend) -> _Run:
    """Grid, task, this rank's stages, its action list, runtime, rings and optimizers."""
    g, t, c = job.grid, job.train, job.comm
    if g.order == "auto":
        raise ConfigError("grid.order = 'auto' is chosen before training (predict.auto."
                          "resolve_order, as the mpihybrid command does)")  # fmt: skip
    on_host = backend.xp is np
    grid = ProcessGrid.build(world, g.layout)
    task = build_task(job.data)
    M, v = t.microbatches, t.virtual_stages
    placement = placement_of(t.schedule, g.pp, v)
    num_stages = placement.num_stages
    compute = build_schedule(t.schedule, g.pp, M, v, t.early_grad_send)
    actions = lower(compute, placement)[grid.pp_rank]
    stages = {
        s: build_stage(job.model, task.in_features, task.num_classes, s, num_stages, t.seed)
        for s in placement.stages_of(grid.pp_rank)
    }
    if job.model.init:  # the file was checked against the model (config.validate)
        for st in stages.values():
            load_into(st, job.model.init, job.model.depth + 2)  # gpt: embedding, layers, head
    if not on_host:
        for st in stages.values():
            st.to_device(backend.asarray)  # initialised on the host: the same draws everywhere
    mb_size = job.microbatch_size
    shapes = boundary_shapes(job.model, task.in_features, task.num_classes, num_stages, mb_size)
    recorder, trace = _build_trace(job, world, grid.dp_rank, len(actions))
    peer_ranks = grid.layout.pipeline_ranks(grid.dp_rank)
    try:
        nodes = node_map(world)  # collective: which ranks share a node (comm.nodes)
    except NodeMapError as exc:
        raise ConfigError(str(exc)) from None
    wire = P2PWire.build(
        c.p2p_codec, encoded_peers(c.p2p_codec_scope, world.Get_rank(), peer_ranks, nodes)
    )
    # a GPU's arrays belong to the main thread's device context: its buckets go after the step;
    # its rings encode on the device and MPI sees the encoded bytes (staged through the host)
    overlap = c.overlap if on_host else "off"
    gradcomm = GradientComm(
        grid.dp_comm, overlap, c.segment_kb * 256, backend,
        groups=_node_groups(job, world, grid, nodes),
    )  # fmt: skip
    codec = get_codec(c.codec, c.block)
    # ZeRO-1: the buckets' rings reduce-scatter, the owner updates, a weight ring gathers
    param_codec = get_codec(c.param_codec or "fp32", c.block) if t.shard_optimizer else None
    rings = {
        s: gradcomm.reducer(
            s, st.flat_grads, st.param_ranges, codec, c.error_feedback, c.bucket_kb * 1024,
            st.flat_params, param_codec, tuple(st.tensor_offsets),
        )
        for s, st in stages.items()
    }  # fmt: skip
    for st in stages.values():
        st.recompute = t.recompute == "full"
    for ring in rings.values():
        ring.hold = t.grad_clip > 0  # the updates wait for the global norm (train/clip.py)
    runtime = PipelineRuntime(
        grid.pp_comm, stages, actions, placement, M, shapes, recorder, c.sync_sends, backend,
        peer_ranks, grads_final=lambda s, lo: rings[s].ready_from(lo),
        poll=gradcomm.poll if gradcomm.progress == "poll" else None, wire=wire,
    )  # fmt: skip
    # the flight recorder is made before the build; train() hands it to the runtime after
    return _Run(
        grid=grid,
        task=task,
        backend=backend,
        stages=stages,
        recorder=recorder,
        runtime=runtime,
        gradcomm=gradcomm,
        rings=rings,
        optimizers={s: _optimizer(t, st, rings[s]) for s, st in stages.items()},
        ring_peer=grid.replica_neighbour(+1),
        peak_inflight=dict.fromkeys(stages, 0),
        trace=trace,
        world=world,
        grad_clip=t.grad_clip,
    )


def _node_groups(job: Job, world: MPI.Comm, grid: ProcessGrid, nodes: list[int] | None):
    """The dp group's nodes when its ring is the two-level one (comm.ring), else None; asked
    for on one node: one warning (world rank 0), then the flat ring. Collective over dp_comm."""
    dp_nodes = None
    if nodes is not None:
        dp_nodes = [nodes[r] for r in grid.layout.replica_ranks(grid.pp_rank)]
    kind, warning = ring_kind(job.comm.ring, dp_nodes)
    told = world.allreduce(int(bool(warning)), op=MPI.MAX)  # one line, whichever stage warned
    if told and world.rank == 0:
        log.warning("%s", warning or "comm.ring = 'hierarchical': a stage's replicas share one "
                    "node: the flat ring there")  # fmt: skip
    return NodeGroups(grid.dp_comm, dp_nodes) if kind == "hierarchical" else None


def _optimizer(t, stage, reducer):
    """The stage's optimizer: over the whole stage, or (train.shard_optimizer) over the chunks
    of its buckets this replica owns, with an fp32 master copy when the weight gather is lossy."""
    if not t.shard_optimizer:
        return build_optimizer(t, stage.flat_params)
    return ShardedOptimizer(t, stage.flat_params, reducer.owned, reducer.lossy_gather)


def _build_trace(job: Job, world: MPI.Comm, dp_rank: int, num_actions: int):
    """The recorder (this rank's events of the traced steps, a buffer for the steps between two
    flushes) and the stream that flushes it; rank 0 also holds the file's writer."""
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
        attrs = _run_attrs(world, job, hostnames)
        attrs["host_cores"] = [cores for _, cores in hosts]  # analysis: oversubscribed or not
        writer = TraceWriter(tr.path, config=to_toml(job), attrs=attrs, overwrite=tr.overwrite)
    stream = TraceStream(world, recorder, writer, bool(tr.path), tr.flush_steps, tr.flush_seconds)
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


def _train_step(job: Job, world: MPI.Comm, run: _Run, step: int, quiet: bool) -> None:
    """One step on this rank: pipeline, all-reduce, optimizer, metrics; a checkpoint when due
    (and a StopRequested after it when a rank was told to stop)."""
    g, t = job.grid, job.train
    grid, backend, rec = run.grid, run.backend, run.recorder
    t_step = Recorder.clock()
    for st in run.stages.values():
        st.zero_grad()
    batches = replica_microbatches(
        run.task, step, t.global_batch, grid.dp_rank, grid.dp_size, t.microbatches
    )
    if backend.xp is not np:
        batches = [(backend.asarray(bx), backend.asarray(by)) for bx, by in batches]
    _begin_updates(run, learning_rate(t, step))
    result = run.runtime.run_step(step, batches)
    # the ring waits on its predecessor most directly (with dp = 1 there is no ring)
    source = grid.replica_neighbour(-1)
    i = run.flight.begin("grad_wait", step + 1, peer=source if grid.dp_size > 1 else -1)
    _reduce_and_update(run, step)
    run.flight.end(i)
    rec.record(KIND["step"], step, -1, -1, t_step, Recorder.clock())
    for s, n in result.peak_inflight.items():
        run.peak_inflight[s] = max(run.peak_inflight[s], n)
    # One small collective per step: the metrics, whether any rank was told to stop, whether
    # any gradient is not finite (agreed here, at a step boundary, never inside a handler).
    bad = _nonfinite_stages(run)
    mine = np.array(
        [result.loss_sum, result.correct, result.samples, run.trace.asks(), len(bad),
         *signal_counts(run.signals)]
    )  # fmt: skip
    sums = np.empty_like(mine)
    i = run.flight.begin("metrics allreduce", step + 1)
    world.Allreduce(mine, sums, op=MPI.SUM)
    run.flight.end(i)
    run.watchdog.at_boundary()
    run.losses.append(float(sums[0] / (g.dp * t.microbatches)))
    run.accuracies.append(float(sums[1] / max(sums[2], 1)))
    finite = bool(np.isfinite(sums[0])) and not sums[4]
    stop = agreed_stop(job, sums[5:])
    if stop is not None or not finite:
        run.watchdog.settle()
    _trace_step(job, run, step, asked=sums[3] > 0, stopping=stop is not None or not finite)
    if not quiet and t.log_every and ((step + 1) % t.log_every == 0 or step == t.steps - 1):
        _log_step(job, world, run, step)  # collective: the peak memory over the ranks
    if not finite:  # before any checkpoint: never one of these weights
        _stop_nonfinite(world, job, step, float(sums[0]), bad)
    if t.eval_every and ((step + 1) % t.eval_every == 0 or step == t.steps - 1):
        i = run.flight.begin("held-out loss", step + 1)
        _eval_step(job, world, run, step, quiet)
        run.flight.end(i)
    if sums[5] and not job.checkpoint.dir and not run.usr1_warned:
        run.usr1_warned = True
        if world.rank == 0:
            log.warning(
                "preemption signal received but checkpoint.dir is not set: cannot "
                "checkpoint; training goes on until it ends or is killed"
            )
    every = job.checkpoint.every
    path = None
    if stop == "preempt" or (every and (step + 1) % every == 0):
        path = _save_checkpoint(job, world, run, step)
    if stop is not None:
        raise stop_exception(stop, step + 1, path)


def _save_checkpoint(job: Job, world: MPI.Comm, run: _Run, step: int) -> str:
    """Collective: every rank's part of the checkpoint after `step` (0-based)."""
    i = run.flight.begin("checkpoint", step + 1)
    try:
        path = checkpoint.save_all(
            world, run.grid.dp_rank, job, step + 1, run.stages, run.optimizers, run.rings,
            run.losses, run.accuracies,
        )  # fmt: skip
    except checkpoint.CheckpointError as exc:  # every rank alike
        raise TrainingStopped(step + 1, str(exc)) from None
    run.flight.end(i)
    return path


def _stop_before_training(job: Job, world: MPI.Comm, run: _Run) -> None:
    """Collective, once the model is built: a stop signal that came during start-up ends the run
    now, before any step (nothing new to checkpoint)."""
    counts = np.array(signal_counts(run.signals))
    world.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    stop = agreed_stop(job, counts)
    if stop is not None:
        run.watchdog.settle()
        raise stop_exception(stop, run.start, None)


def _log_step(job: Job, world: MPI.Comm, run: _Run, step: int) -> None:
    """Rank 0's step line, as torchtitan's metrics line: loss, accuracy, then over the steps
    since the last line: ms per step, throughput (tokens/s for token data), the share of the
    GEMM roofline (with peak_flops), every rank's peak memory, and the time left at that pace."""
    peak = world.allreduce(peak_rss_bytes(), op=MPI.MAX)
    if world.rank != 0:
        return
    t = job.train
    first, since, evals = run.log_from
    now = Recorder.clock()
    run.log_from = (step + 1, now, run.eval_s)
    steps = step + 1 - first
    per_step = (now - since - (run.eval_s - evals)) / max(steps, 1)  # evaluations left out
    tokens = job.tokens_per_sample
    rows_per_s = t.global_batch * tokens / per_step if per_step > 0 else 0.0
    unit = "tokens/s" if tokens > 1 else "samples/s"
    parts = [
        f"step {step + 1}/{t.steps}",
        f"loss {run.losses[-1]:.4f}",
        f"acc {run.accuracies[-1]:.3f}",
        f"lr {learning_rate(t, step):.3g}",
        *([f"grad norm {run.grad_norm:.3g}"] if t.grad_clip else []),
        f"{1e3 * per_step:.1f} ms/step",
        f"{rows_per_s:,.0f} {unit}",
    ]
    if run.peak_flops:
        flops = sum(block_costs(build_blocks(job.model, *task_dims(job.data))))
        parts.append(f"roofline {100 * flops * rows_per_s / (world.size * run.peak_flops):.0f}%")
    parts.append(f"peak mem {human_bytes(peak)}")
    left = (t.steps - step - 1) * per_step
    if left > 0:
        parts.append(f"left {_duration(left)}")
    log.info("%s", "  ".join(parts))


def _duration(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _eval_step(job: Job, world: MPI.Comm, run: _Run, step: int, quiet: bool) -> None:
    """Collective: the held-out loss after `step`, into the log, the trace and the Summary."""
    t0 = Recorder.clock()
    metrics = heldout_loss(job, world, run)
    run.eval_s += Recorder.clock() - t0
    run.evals.append({"step": step + 1, **metrics})
    run.trace.add_eval(step, metrics)
    if not quiet and world.rank == 0:
        per_byte = metrics["bits_per_byte"]
        log.info(
            "eval %d/%d  val loss %.4f nats  %.3f bits/token%s  perplexity %.2f",
            step + 1, job.train.steps, metrics["loss"], metrics["bits_per_token"],
            "" if math.isnan(per_byte) else f"  {per_byte:.3f} bits/byte", metrics["perplexity"],
        )  # fmt: skip


def heldout_loss(job: Job, world: MPI.Comm, run: _Run) -> dict[str, float]:
    """Collective: mean cross-entropy of the model on train.eval_batches global batches of
    held-out samples (the same ones every time), every replica's pipeline running its share
    forward in pieces (eval_pieces); the same numbers on every rank."""
    g, t = job.grid, job.train
    placement = run.runtime.placement
    num_stages = placement.num_stages
    if run.eval_set is None:
        x, y = heldout(run.task, t.eval_batches * t.global_batch)
        mine = np.array_split(np.arange(len(x)), g.dp)[run.grid.dp_rank]
        run.eval_set = (x[mine], y[mine])
    x, y = run.eval_set
    rows = eval_pieces(job, len(x), run.task.num_classes, max(y[:1].size, 1))
    nats, targets = 0.0, 0
    for i in range(0, len(x), rows):
        shapes = boundary_shapes(
            job.model, run.task.in_features, run.task.num_classes, num_stages, len(x[i : i + rows])
        )
        piece = x[i : i + rows] if run.backend.xp is np else run.backend.asarray(x[i : i + rows])
        logits = forward_only(run.grid.pp_comm, run.stages, placement, piece, shapes, run.backend)
        if logits is not None:
            nats += cross_entropy_sum(run.backend.to_host(logits), y[i : i + rows])
            targets += y[i : i + rows].size
    nats, targets = world.allreduce(np.array([nats, targets], np.float64), op=MPI.SUM)
    loss = float(nats / max(targets, 1))
    per_token = loss / math.log(2)
    per_byte = getattr(run.task, "bytes_per_token", None)
    return {
        "loss": loss,
        "bits_per_token": per_token,
        "bits_per_byte": per_token / per_byte if per_byte else math.nan,
        "perplexity": math.exp(min(loss, 700.0)),
    }


def cross_entropy_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum over rows of -log softmax(logits)[target], logits (..., K), targets (...)."""
    flat = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    t = targets.reshape(-1)
    top = flat.max(axis=1)
    lse = np.log(np.exp(flat - top[:, None]).sum(axis=1)) + top
    return float(np.sum(lse - flat[np.arange(len(t)), t]))


def _nonfinite_stages(run: _Run) -> list[int]:
    """This rank's stages whose reduced gradient holds a nan or an inf: one sum over each flat
    gradient (nan and inf survive a sum; a finite gradient's fp32 sum overflows only past
    3e38, and a gradient that large has diverged anyway)."""
    return [s for s, st in run.stages.items() if not math.isfinite(float(st.flat_grads.sum()))]


def _stop_nonfinite(world: MPI.Comm, job: Job, step: int, loss_sum: float, bad: list[int]):
    """Collective, on every rank alike: name the step and the stages, raise TrainingStopped."""
    stages = sorted({s for part in world.allgather(bad) for s in part})
    if not math.isfinite(loss_sum):
        last = job.grid.pp * job.train.virtual_stages - 1
        what = f"the loss is {loss_sum} (stage {last}, the last)"
    else:
        what = f"the gradient of stage {', '.join(map(str, stages))} is not finite (nan or inf)"
        hint = overflow_hint(job.comm.codec)
        what += f" ({hint})" if hint else ""
    raise TrainingStopped(
        step + 1, f"step {step + 1}: {what}; stopped without writing a checkpoint of these weights"
    )


def _begin_trace(job: Job, run: _Run, to_run_start: float, resumed: bool) -> None:
    """The trace's first version (rank 0): a resumed run continues the trace at its path, or
    starts one holding the checkpoint's losses of the earlier steps."""
    rates = [learning_rate(job.train, i) for i in range(run.start)]
    earlier = {"loss": run.losses, "accuracy": run.accuracies, "lr": rates} if resumed else None
    if run.trace.writer is not None:  # `why` leaves out flight records older than this run
        run.trace.writer.attrs["run_started_at"] = run.flight.run_started
    run.trace.begin(to_run_start, run.start if resumed else None, earlier)


# a run without a trace file keeps the rows of its last UNTRACED_STEPS to 2 x UNTRACED_STEPS
# steps for its report (Summary.events), not every step's (1.6 KB a step at hidden 16)
UNTRACED_STEPS = 256


def _trace_step(job: Job, run: _Run, step: int, asked: bool, stopping: bool) -> None:
    """At the step boundary every rank reached: the step's metrics to the trace, and a flush when
    due (never after the last step: _finish writes that; always before a preemption's exit)."""
    more = {"grad_norm": run.grad_norm} if run.grad_clip else {}
    run.trace.add_step(
        step, run.losses[-1], run.accuracies[-1], lr=learning_rate(job.train, step), **more
    )
    last = step == job.train.steps - 1
    if stopping or (not last and run.trace.due(step, asked)):
        run.trace.flush(attrs={"stopped_at_step": step + 1} if stopping else None)
    elif not run.trace.writing and (step + 1) % UNTRACED_STEPS == 0:
        run.recorder.drop_before(step + 1 - UNTRACED_STEPS)  # memory flat over a long run


def _begin_updates(run: _Run, lr: float) -> None:
    """Each stage's optimizer starts its step at rate `lr`; a reduced bucket updates its slice of
    the parameters (where they live: on a GPU the update's kernels finish before the trace's
    clock)."""
    for s, st in run.stages.items():
        optimizer = run.optimizers[s]
        optimizer.begin_step(lr)

        def update(lo, hi, st=st, optimizer=optimizer, backend=run.backend) -> None:
            optimizer.update(st.flat_grads, lo, hi)
            backend.synchronize()  # a no-op on the CPU

        run.rings[s].begin_step(update, getattr(optimizer, "master_of", None))


def _reduce_and_update(run: _Run, step: int) -> None:
    """Wait for every gradient bucket to be reduced and its parameters updated (most are, behind
    the pipeline's compute); trace each bucket's ring and update, and the wait itself."""
    rec = run.recorder
    t0 = Recorder.clock()
    events = run.gradcomm.finish()
    rec.record(KIND["grad_wait"], step, -1, -1, t0, Recorder.clock())
    if run.grad_clip:
        events = _clip_and_update(run, events)
    for ev in events:
        rec.record(
            KIND["allreduce"], step, ev.stage, ev.bucket, ev.start, ev.reduced, ev.nbytes,
            run.ring_peer,
        )  # fmt: skip
        rec.record(KIND["optimizer"], step, ev.stage, ev.bucket, ev.reduced, ev.end)
        if run.rings[ev.stage].sharded:  # the weight all-gather: a second ring row
            rec.record(
                KIND["allreduce"], step, ev.stage, ev.bucket, ev.end, ev.gathered,
                ev.gather_nbytes, run.ring_peer,
            )  # fmt: skip


def _clip_and_update(run: _Run, events: list) -> list:
    """train.grad_clip: the global norm (collective), the reduced gradients clipped by it, then
    every held bucket's update (and sharded, its weight gather), in stage and bucket order on
    every replica; the events carry the updates' own times."""
    run.grad_norm = clip.global_norm(run.world, run.stages, run.rings, run.grid.dp_rank)
    run.grad_norms.append(run.grad_norm)
    coef = clip.clip_coefficient(run.grad_norm, run.grad_clip)
    if coef < 1.0:
        clip.scale(run.stages, run.rings, coef)
    by_bucket = {(ev.stage, ev.bucket): ev for ev in events}
    for s in sorted(run.rings):
        for i in range(len(run.rings[s].buckets)):
            ev = by_bucket[(s, i)]
            ev.reduced = Recorder.clock()  # the optimizer row starts here, not at the ring's end
            ev.end, ev.gathered, ev.gather_nbytes = run.rings[s].release(i)
    return events


def _finish(
    job: Job, world: MPI.Comm, run: _Run, runtime_s: float, collect: bool
) -> Summary | None:
    """Collectives after the last step (evaluation, replica check, bytes, the trace's last
    flush), then rank 0 builds the Summary."""
    t = job.train
    grid, stages, placement = run.grid, run.stages, run.runtime.placement
    num_stages = placement.num_stages
    flight = run.flight
    i = flight.begin("evaluate")
    test_accuracy = _evaluate(job, world, run)
    flight.end(i)
    i = flight.begin("replica check")
    replica_diff = _replica_check(world, grid, stages)
    bytes_sent = _bytes_sent(world, run.runtime, run.rings)
    peaks = world.gather(run.peak_inflight, root=0)
    peak_rss = world.gather(run.peak_rss, root=0)
    flight.end(i)
    _checkpoint_if_signalled(job, world, run)
    # the rows since the last flush (every row when no trace file is written), on rank 0
    i = flight.begin("trace flush")
    events = run.trace.flush(_end_attrs(runtime_s, test_accuracy, peak_rss), finished=True)
    flight.end(i)
    _release(run)
    params = gather_parameters(world, grid, stages, num_stages) if collect else None
    if world.rank != 0:
        return None

    ran = t.steps - run.start
    summary = Summary(
        steps=t.steps,
        runtime_s=runtime_s,
        samples_per_s=ran * t.global_batch / runtime_s if runtime_s > 0 else 0.0,
        losses=run.losses.kept(),
        accuracies=run.accuracies.kept(),
        test_accuracy=test_accuracy,
        bytes_sent=bytes_sent,
        replica_max_diff=replica_diff,
        peak_inflight=dict(sorted({s: n for d in peaks for s, n in d.items()}.items())),
        grid_as_run=_last_grid(events, placement, t.steps - 1) if ran > 0 else "",
        params=params,
        events=events,
        trace_path=job.trace.path,
        peak_rss_bytes=peak_rss,
        evals=run.evals,
        extra={"grad_norms": run.grad_norms} if t.grad_clip else {},
    )
    return summary


def _release(run: _Run) -> None:
    """Collective, at a normal end or an agreed stop: the communication thread, the rings'
    shared windows and the grid's communicators. A window left to MPI_Finalize fails it on some
    fabrics (MPICH over OFI: "fabricclose failed ... Device or resource busy", exit 15); a sweep
    calls train() many times in one process."""
    run.gradcomm.close()
    for s in sorted(run.rings):
        run.rings[s].close()
    run.gradcomm.free_groups()
    run.grid.free()


def _checkpoint_if_signalled(job: Job, world: MPI.Comm, run: _Run) -> None:
    """Collective: a preemption signal that came after the last step's boundary still gets the
    final checkpoint (when there is a checkpoint.dir and the last step has none); the run then
    finishes its report and trace and exits 0, since nothing is left to requeue."""
    counts = np.array(signal_counts(run.signals))
    world.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    usr1, term, _ = counts
    every, steps = job.checkpoint.every, job.train.steps
    if not (usr1 or term) or steps == run.start:
        return
    saved = ""
    if job.checkpoint.dir and not (every and steps % every == 0):
        saved = f"; final checkpoint written to {_save_checkpoint(job, world, run, steps - 1)}"
    if world.rank == 0:
        log.warning("a stop signal came after the last step: the run finishes%s", saved)


def _last_grid(events: np.ndarray, placement, step: int) -> str:
    # a trace window that leaves out the last step leaves nothing to draw
    return grid_as_run(events, placement, step) if np.any(events["step"] == step) else ""


def _end_attrs(runtime_s: float, test_accuracy: float, peak_rss: list[int] | None) -> dict:
    """The trace attributes known only at the end (this part's runtime after a resume; every
    rank's peak resident set over the steps, on rank 0, which writes them)."""
    attrs = {"runtime_s": runtime_s, "test_accuracy": test_accuracy}
    return attrs if peak_rss is None else {**attrs, "peak_rss_bytes": [int(b) for b in peak_rss]}


EVAL_LOGITS = 1 << 22  # logits held at once by the evaluation (16 MiB of float32)


def eval_pieces(job: Job, rows: int, classes: int, tokens: int) -> int:
    """Rows forward at once in an evaluation: a training micro-batch (so its memory is within
    the steps' and a stage waits on the one before it about one forward), at most EVAL_LOGITS
    logits."""
    return max(1, min(job.microbatch_size, EVAL_LOGITS // max(tokens * classes, 1), rows))


def _evaluate(job: Job, world, run: _Run) -> float:
    """Held-out accuracy (gpt: of every next token): every replica's pipeline runs its share of
    the test set forward in pieces (eval_pieces), ticking the watchdog after each; the same
    number on every rank."""
    grid, task, backend = run.grid, run.task, run.backend
    placement = run.runtime.placement
    num_stages = placement.num_stages
    n, dp, r = len(task.test_x), grid.dp_size, grid.dp_rank
    lo, hi = n * r // dp, n * (r + 1) // dp
    rows = eval_pieces(job, hi - lo, task.num_classes, task.test_y[0].size)
    correct = 0
    for i in range(lo, hi, rows):
        x, y = task.test_x[i : min(i + rows, hi)], task.test_y[i : min(i + rows, hi)]
        shapes = boundary_shapes(job.model, task.in_features, task.num_classes, num_stages, len(x))
        x = x if backend.xp is np else backend.asarray(x)
        logits = forward_only(grid.pp_comm, run.stages, placement, x, shapes, backend)
        if logits is not None:
            predicted = backend.to_host(logits.argmax(axis=-1))
            correct += int(np.count_nonzero(predicted == y))
    return world.allreduce(correct, op=MPI.SUM) / task.test_y.size


REPLICA_BLOCK = 1 << 18  # floats compared at once by the replica check (1 MiB)


def _replica_check(world, grid, stages) -> dict[int, float]:
    """max |w - w_replica0| for every stage (0.0 means the replicas are bit-identical), in
    blocks of REPLICA_BLOCK: the whole-stage copy, difference and absolute value it once made
    were three parameter-sized temporaries at the end of a run, the run's memory peak
    (+220 MiB a rank at hidden 3072)."""
    local = {}
    for s, st in stages.items():
        mine, diff = host_array(st.flat_params), 0.0
        block = np.empty(min(REPLICA_BLOCK, mine.size), np.float32)
        for lo in range(0, mine.size if grid.dp_size > 1 else 0, REPLICA_BLOCK):
            piece = block[: min(REPLICA_BLOCK, mine.size - lo)]
            piece[...] = mine[lo : lo + len(piece)]
            grid.dp_comm.Bcast([piece, MPI.FLOAT], root=0)
            np.subtract(mine[lo : lo + len(piece)], piece, out=piece)
            worst = float(np.abs(piece, out=piece).max())
            diff = worst if worst != worst else max(diff, worst)  # a nan stays
        local[s] = grid.dp_comm.allreduce(diff, op=MPI.MAX)
    gathered = world.gather(local if grid.dp_rank == 0 else {}, root=0)
    return {s: d for part in gathered or [] for s, d in part.items()}


def gather_parameters(world, grid, stages, num_stages) -> list[np.ndarray] | None:
    """Replica 0's flat parameters of every stage, on world rank 0, in stage order."""
    mine = {s: st.num_params for s, st in stages.items()} if grid.dp_rank == 0 else {}
    sizes = world.gather(mine, root=0)
    if grid.dp_rank == 0 and world.rank != 0:
        for s in sorted(stages):
            world.Send([host_array(stages[s].flat_params), MPI.FLOAT], dest=0, tag=s)
    if world.rank != 0:
        return None
    owners = {s: (r, n) for r, part in enumerate(sizes) for s, n in part.items()}
    params = []
    for s in range(num_stages):
        owner, n = owners[s]
        if owner == 0:
            params.append(np.array(host_array(stages[s].flat_params)))
        else:
            buf = np.empty(n, np.float32)
            world.Recv([buf, MPI.FLOAT], source=owner, tag=s)
            params.append(buf)
    return params


def _bytes_sent(world, runtime, rings) -> dict[str, int]:
    mine = dict(runtime.bytes_sent)
    for ring in rings.values():
        for kind, n in ring.bytes_sent.items():
            mine[kind] = mine.get(kind, 0) + n
    gathered = world.gather(mine, root=0)
    if gathered is None:
        return {}
    total: dict[str, int] = {}
    for part in gathered:
        for kind, n in part.items():
            total[kind] = total.get(kind, 0) + int(n)
    return total


def _placement(job: Job):
    return placement_of(job.train.schedule, job.grid.pp, job.train.virtual_stages)


def layout_attrs(job: Job, world_size: int) -> dict:
    """The trace attributes that say how the run was laid out (what analysis reads back); a
    csv: schedule's text goes with them, so its trace is analysed without the file."""
    schedule = job.train.schedule
    text = {"schedule_csv": csv_text(schedule)} if schedule.startswith("csv:") else {}
    return {
        "world_size": world_size,
        "pp": job.grid.pp,
        "dp": job.grid.dp,
        "schedule": job.train.schedule,
        "microbatches": job.train.microbatches,
        "virtual_stages": job.train.virtual_stages,
        "stage_ranks": np.array(_placement(job).stage_ranks, np.int64),  # pp rank of each stage
        "early_grad_send": job.train.early_grad_send,
        "codec": job.comm.codec,
        "p2p_codec": job.comm.p2p_codec,
        "device": job.grid.device,
        **text,
        **search_attrs(schedule),
    }


def _run_attrs(world, job: Job, hostnames: list[str]) -> dict:
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
