"""The training loop: grid, stages, schedule, then per step: pipeline, ring all-reduce, optimizer.

    mpiexec -n 12 mpihybrid train jobs/seed_k3_d4.toml --trace runs/seed.h5

Every rank runs this function; rank 0 gathers metrics, the trace and the report.
"""

from __future__ import annotations

import logging
import platform
import signal
import socket
import sys
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpihybrid import __version__
from mpihybrid.comm.buckets import GradientComm
from mpihybrid.comm.codecs import get_codec
from mpihybrid.comm.device import (
    Backend,
    copy_from_host,
    host_array,
    keep_freed_host_memory,
    select_backend,
)
from mpihybrid.comm.grid import ProcessGrid
from mpihybrid.config import Job, to_toml
from mpihybrid.nn.data import build_task, microbatches
from mpihybrid.nn.model import boundary_shapes, build_stage
from mpihybrid.nn.optim import build_optimizer
from mpihybrid.pipeline.as_run import grid_as_run
from mpihybrid.pipeline.runtime import PipelineRuntime, forward_only
from mpihybrid.pipeline.schedules import build_schedule, lower, stage_rank
from mpihybrid.trace.file import write_trace
from mpihybrid.trace.recorder import (
    KIND,
    Recorder,
    StepRecorder,
    clock_offset,
    gather_events,
    step_times,
)
from mpihybrid.train import checkpoint

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
    events: np.ndarray | None = None  # every rank's trace events, rank 0's clock, run start = 0
    extra: dict = field(default_factory=dict)


def train(
    job: Job,
    world: MPI.Comm,
    quiet: bool = False,
    collect_params: bool = False,
    resume_from: str | None = None,
    backend: Backend | None = None,
) -> Summary | None:
    """Run the job on every rank of `world`; rank 0 gets the Summary, the others None.

    resume_from: a complete checkpoint directory (checkpoint.latest) to continue from.
    Raises Preempted on every rank after writing a checkpoint when a rank got SIGUSR1/SIGTERM.

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
    run = _build(job, world, backend)
    if resume_from is not None:
        run.start, run.losses, run.accuracies = checkpoint.restore_all(
            world, run.grid.dp_rank, job, resume_from, run.stages, run.optimizers, run.rings
        )
    preempt = _PreemptionFlag(enabled=bool(job.checkpoint.dir))

    offset = clock_offset(world)
    world.Barrier()
    t_start = Recorder.clock()
    # Rank 0's clock at the start, for traces relative to the run's start.
    t_origin = world.bcast(t_start + offset if world.rank == 0 else None, root=0)
    for step in range(run.start, job.train.steps):
        _train_step(job, world, run, step, preempt, quiet)
    preempt.restore()
    runtime_s = Recorder.clock() - t_start
    return _finish(job, world, run, runtime_s, offset - t_origin, collect_params)


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
    host_grads: dict  # stage -> host copy of a device gradient, for the ring
    ring_peer: int  # world rank the ring sends to (the trace's peer of an all-reduce)
    start: int = 0  # first step to run (after a resume, the checkpoint's)
    losses: list = field(default_factory=list)
    accuracies: list = field(default_factory=list)
    peak_inflight: dict = field(default_factory=dict)
    step_sums: np.ndarray = field(default_factory=lambda: np.zeros(4))


def _build(job: Job, world: MPI.Comm, backend: Backend) -> _Run:
    """Grid, task, this rank's stages, its action list, runtime, rings and optimizers."""
    g, t, c = job.grid, job.train, job.comm
    on_host = backend.xp is np
    grid = ProcessGrid.build(world, g.pp, g.dp, g.order)
    task = build_task(job.data)
    M, v = t.microbatches, t.virtual_stages
    num_stages = g.pp * v
    compute = build_schedule(t.schedule, g.pp, M, v, t.early_grad_send)
    actions = lower(compute, g.pp, v)[grid.pp_rank]
    stages = {
        s: build_stage(job.model, task.in_features, task.num_classes, s, num_stages, t.seed)
        for s in range(num_stages)
        if stage_rank(s, g.pp, v) == grid.pp_rank
    }
    if not on_host:
        for st in stages.values():
            st.to_device(backend.asarray)  # initialised on the host: the same draws everywhere
    mb_size = t.global_batch // (g.dp * M)
    shapes = boundary_shapes(job.model, task.in_features, task.num_classes, num_stages, mb_size)
    recorder_cls = Recorder if job.trace.events else StepRecorder
    recorder = recorder_cls(world.rank, grid.dp_rank, capacity=(len(actions) + 8) * max(t.steps, 1))
    peer_ranks = [grid.world_rank_of(p, grid.dp_rank, g.order) for p in range(g.pp)]
    # the ring (numpy codecs) runs on host copies of device gradients; dp = 1 moves nothing
    host_grads = {
        s: np.empty(st.num_params, np.float32)
        for s, st in stages.items()
        if not on_host and grid.dp_size > 1
    }
    # a GPU's arrays belong to the main thread's device context: its buckets go after the step
    gradcomm = GradientComm(grid.dp_comm, c.overlap if on_host else "off", c.segment_kb * 256)
    codec = get_codec(c.codec, c.block)
    rings = {
        s: gradcomm.reducer(
            s, host_grads.get(s, st.flat_grads), st.param_ranges, codec, c.error_feedback,
            c.bucket_kb * 1024,
        )
        for s, st in stages.items()
    }  # fmt: skip
    runtime = PipelineRuntime(
        grid.pp_comm, stages, actions, num_stages, M, shapes, recorder, c.sync_sends, backend,
        peer_ranks, grads_final=lambda s, lo: rings[s].ready_from(lo),
        poll=gradcomm.poll if gradcomm.progress == "poll" else None,
    )  # fmt: skip
    return _Run(
        grid=grid,
        task=task,
        backend=backend,
        stages=stages,
        recorder=recorder,
        runtime=runtime,
        gradcomm=gradcomm,
        rings=rings,
        optimizers={s: build_optimizer(t, st.flat_params) for s, st in stages.items()},
        host_grads=host_grads,
        ring_peer=grid.world_rank_of(grid.pp_rank, (grid.dp_rank + 1) % grid.dp_size, g.order),
        peak_inflight=dict.fromkeys(stages, 0),
    )


def _train_step(
    job: Job, world: MPI.Comm, run: _Run, step: int, preempt: _PreemptionFlag, quiet: bool
) -> None:
    """One step on this rank: pipeline, all-reduce, optimizer, metrics; a checkpoint when due
    (Preempted after it when a rank was told to stop)."""
    g, t = job.grid, job.train
    grid, backend, rec = run.grid, run.backend, run.recorder
    t_step = Recorder.clock()
    for st in run.stages.values():
        st.zero_grad()
    x, y = run.task.global_batch(step, t.global_batch)
    batches = microbatches(x, y, grid.dp_rank, grid.dp_size, t.microbatches)
    if backend.xp is not np:
        batches = [(backend.asarray(bx), backend.asarray(by)) for bx, by in batches]
    _begin_updates(run)
    result = run.runtime.run_step(step, batches)
    _reduce_and_update(run, step)
    rec.record(KIND["step"], step, -1, -1, t_step, Recorder.clock())
    for s, n in result.peak_inflight.items():
        run.peak_inflight[s] = max(run.peak_inflight[s], n)
    # One small collective per step: the metrics, and whether any rank was told to stop
    # (agreed here, at a step boundary, never inside the signal handler).
    mine = np.array([result.loss_sum, result.correct, result.samples, preempt.requested])
    sums = run.step_sums
    world.Allreduce(mine, sums, op=MPI.SUM)
    run.losses.append(float(sums[0] / (g.dp * t.microbatches)))
    run.accuracies.append(float(sums[1] / max(sums[2], 1)))
    if not quiet and world.rank == 0:
        log.info(
            "step %d/%d  loss %.4f  train acc %.3f  %.1f ms",
            step + 1, t.steps, run.losses[-1], run.accuracies[-1],
            1e3 * (Recorder.clock() - t_step),
        )  # fmt: skip
    every = job.checkpoint.every
    if sums[3] or (every and (step + 1) % every == 0):
        path = checkpoint.save_all(
            world, grid.dp_rank, job, step + 1, run.stages, run.optimizers, run.rings,
            run.losses, run.accuracies,
        )  # fmt: skip
        if sums[3]:
            raise Preempted(step + 1, path)


def _begin_updates(run: _Run) -> None:
    """Each stage's optimizer starts its step; a reduced bucket updates its slice of the
    parameters (on a GPU after the gradient's host copy went back to the device)."""
    for s, st in run.stages.items():
        optimizer = run.optimizers[s]
        optimizer.begin_step()
        if s in run.host_grads:
            host, backend = run.host_grads[s], run.backend

            def update(lo, hi, st=st, optimizer=optimizer, host=host, backend=backend) -> None:
                copy_from_host(st.flat_grads[lo:hi], host[lo:hi])
                optimizer.update(st.flat_grads, lo, hi)
                backend.synchronize()

        else:

            def update(lo, hi, st=st, optimizer=optimizer) -> None:
                optimizer.update(st.flat_grads, lo, hi)

        run.rings[s].begin_step(update)


def _reduce_and_update(run: _Run, step: int) -> None:
    """Wait for every gradient bucket to be reduced and its parameters updated (most are, behind
    the pipeline's compute); trace each bucket's ring and update, and the wait itself."""
    rec = run.recorder
    for s, host in run.host_grads.items():  # a GPU: the rings start after the pipeline
        run.backend.to_host(run.stages[s].flat_grads, out=host)
    t0 = Recorder.clock()
    events = run.gradcomm.finish()
    rec.record(KIND["grad_wait"], step, -1, -1, t0, Recorder.clock())
    for ev in events:
        rec.record(
            KIND["allreduce"], step, ev.stage, ev.bucket, ev.start, ev.reduced, ev.nbytes,
            run.ring_peer,
        )  # fmt: skip
        rec.record(KIND["optimizer"], step, ev.stage, ev.bucket, ev.reduced, ev.end)


def _finish(
    job: Job, world: MPI.Comm, run: _Run, runtime_s: float, to_run_start: float, collect: bool
) -> Summary | None:
    """Collectives after the last step (evaluation, replica check, bytes, events), then rank 0
    builds the Summary and writes the trace."""
    g, t = job.grid, job.train
    grid, stages, num_stages = run.grid, run.stages, g.pp * t.virtual_stages
    test_accuracy = _evaluate(world, grid, stages, num_stages, run.task, job.model, run.backend)
    replica_diff = _replica_check(world, grid, stages)
    bytes_sent = _bytes_sent(world, run.runtime, run.rings)
    peaks = world.gather(run.peak_inflight, root=0)
    events = gather_events(world, run.recorder, to_run_start)
    hostnames = world.gather(socket.gethostname(), root=0)
    run.gradcomm.close()
    grid.free()  # a sweep calls train() many times in one process
    params = gather_parameters(world, grid, stages, num_stages) if collect else None
    if world.rank != 0:
        return None

    ran = t.steps - run.start
    summary = Summary(
        steps=t.steps,
        runtime_s=runtime_s,
        samples_per_s=ran * t.global_batch / runtime_s if runtime_s > 0 else 0.0,
        losses=run.losses,
        accuracies=run.accuracies,
        test_accuracy=test_accuracy,
        bytes_sent=bytes_sent,
        replica_max_diff=replica_diff,
        peak_inflight=dict(sorted({s: n for d in peaks for s, n in d.items()}.items())),
        grid_as_run=grid_as_run(events, g.pp, t.virtual_stages, t.steps - 1) if ran > 0 else "",
        params=params,
        events=events,
    )
    if job.trace.path:
        _write_trace(job, world, run, summary, hostnames)
    return summary


def _write_trace(job: Job, world: MPI.Comm, run: _Run, summary: Summary, hostnames) -> None:
    # rank 0's own step durations; NaN for steps run before a resume
    own = step_times(run.recorder.events)
    step_time = [own.get(step, np.nan) for step in range(job.train.steps)]
    write_trace(
        job.trace.path,
        events=summary.events,
        steps={
            "loss": np.array(summary.losses),
            "accuracy": np.array(summary.accuracies),
            "step_time": np.array(step_time),
        },
        config=to_toml(job),
        attrs=_run_attrs(world, job, summary, hostnames),
        overwrite=job.trace.overwrite,
    )
    summary.trace_path = job.trace.path


class Preempted(Exception):
    """Every rank stopped at a step boundary after a signal, with a checkpoint written."""

    def __init__(self, step: int, path: str):
        super().__init__(f"preempted at step {step}: checkpoint written to {path}")
        self.step, self.path = step, path


class _PreemptionFlag:
    """SIGUSR1 (SLURM's advance warning) or SIGTERM only set a flag; the loop acts on it."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, enabled: bool):
        self.requested = 0
        self.previous = {}
        if enabled:
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = 1

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


EVAL_LOGITS = 1 << 22  # logits held at once by the evaluation (16 MiB of float32)


def _evaluate(world, grid, stages, num_stages, task, model_cfg, backend) -> float:
    """Held-out accuracy (gpt: of every next token), computed by replica 0's pipeline in
    pieces of at most EVAL_LOGITS logits; returned on world rank 0."""
    accuracy = -1.0
    if grid.dp_rank == 0:
        n = len(task.test_x)
        rows = max(1, EVAL_LOGITS // (task.test_y[0].size * task.num_classes))
        correct = 0
        for i in range(0, n, rows):
            x, y = task.test_x[i : i + rows], task.test_y[i : i + rows]
            shapes = boundary_shapes(
                model_cfg, task.in_features, task.num_classes, num_stages, len(x)
            )
            x = x if backend.xp is np else backend.asarray(x)
            logits = forward_only(grid.pp_comm, stages, num_stages, x, shapes, backend)
            if logits is not None:
                predicted = backend.to_host(logits.argmax(axis=-1))
                correct += int(np.count_nonzero(predicted == y))
        if stage_rank(num_stages - 1, grid.pp_size, num_stages // grid.pp_size) == grid.pp_rank:
            accuracy = correct / task.test_y.size
    return float(world.allreduce(accuracy, op=MPI.MAX))


def _replica_check(world, grid, stages) -> dict[int, float]:
    """max |w - w_replica0| for every stage (0.0 means the replicas are bit-identical)."""
    local = {}
    for s, st in stages.items():
        mine = host_array(st.flat_params)
        reference = mine.copy()
        grid.dp_comm.Bcast([reference, MPI.FLOAT], root=0)
        diff = float(np.max(np.abs(mine - reference))) if st.num_params else 0.0
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


def layout_attrs(job: Job, world_size: int) -> dict:
    """The trace attributes that say how the run was laid out (what analysis reads back)."""
    return {
        "world_size": world_size,
        "pp": job.grid.pp,
        "dp": job.grid.dp,
        "schedule": job.train.schedule,
        "microbatches": job.train.microbatches,
        "virtual_stages": job.train.virtual_stages,
        "early_grad_send": job.train.early_grad_send,
        "codec": job.comm.codec,
        "device": job.grid.device,
    }


def _run_attrs(world, job: Job, summary: Summary, hostnames: list[str]) -> dict:
    return {
        "mpihybrid_version": __version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi4py_version": __import__("mpi4py").__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        **layout_attrs(job, world.Get_size()),
        "hostnames": ",".join(sorted(set(hostnames))),
        "runtime_s": summary.runtime_s,
        "test_accuracy": summary.test_accuracy,
        "command": " ".join(sys.argv),
    }
