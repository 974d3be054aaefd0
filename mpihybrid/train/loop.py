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
from mpihybrid.comm.allreduce import RingAllreduce
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
from mpihybrid.trace.recorder import KIND, Recorder, StepRecorder, clock_offset, gather_events
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
    g, t, c = job.grid, job.train, job.comm
    keep_freed_host_memory()  # numpy's temporaries reuse memory instead of page-faulting it in
    if backend is None:
        backend = select_backend(g.device, c.cuda_aware, world)
    on_host = backend.xp is np
    if not on_host and not quiet:
        log.info("rank %d: %s", world.rank, backend.describe())  # which GPU, which MPI path
    grid = ProcessGrid.build(world, g.pp, g.dp, g.order)
    task = build_task(job.data)
    M, v = t.microbatches, t.virtual_stages
    num_stages = g.pp * v
    mb_size = t.global_batch // (g.dp * M)

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
    shapes = boundary_shapes(job.model, task.in_features, task.num_classes, num_stages, mb_size)
    recorder_cls = Recorder if job.trace.events else StepRecorder
    recorder = recorder_cls(world.rank, grid.dp_rank, capacity=(len(actions) + 8) * max(t.steps, 1))
    peer_ranks = [grid.world_rank_of(p, grid.dp_rank, g.order) for p in range(g.pp)]
    runtime = PipelineRuntime(
        grid.pp_comm, stages, actions, num_stages, M, shapes, recorder, c.sync_sends, backend,
        peer_ranks,
    )  # fmt: skip
    codec = get_codec(c.codec, c.block)
    rings = {
        s: RingAllreduce(grid.dp_comm, st.num_params, codec, c.error_feedback)
        for s, st in stages.items()
    }
    optimizers = {s: build_optimizer(t, st.flat_params) for s, st in stages.items()}
    # the ring (numpy codecs) runs on host copies of device gradients; dp = 1 moves nothing
    host_grads = {
        s: np.empty(st.num_params, np.float32)
        for s, st in stages.items()
        if not on_host and grid.dp_size > 1
    }
    ring_peer = grid.world_rank_of(grid.pp_rank, (grid.dp_rank + 1) % grid.dp_size, g.order)

    start, losses, accuracies = 0, [], []
    if resume_from is not None:
        start, losses, accuracies = checkpoint.restore_all(
            world, grid.dp_rank, job, resume_from, stages, optimizers, rings
        )
    preempt = _PreemptionFlag(enabled=bool(job.checkpoint.dir))

    offset = clock_offset(world)
    world.Barrier()
    t_start = Recorder.clock()
    # Rank 0's clock at the start, for traces relative to the run's start.
    t_origin = world.bcast(t_start + offset if world.rank == 0 else None, root=0)
    peak_inflight = {s: 0 for s in stages}
    step_sums = np.zeros(4)  # loss_sum, correct, samples, preemption requests: over all ranks
    for step in range(start, t.steps):
        t_step = Recorder.clock()
        for st in stages.values():
            st.zero_grad()
        x, y = task.global_batch(step, t.global_batch)
        batches = microbatches(x, y, grid.dp_rank, grid.dp_size, M)
        if not on_host:
            batches = [(backend.asarray(bx), backend.asarray(by)) for bx, by in batches]
        result = runtime.run_step(step, batches)
        for s, st in stages.items():
            t0 = Recorder.clock()
            if s in host_grads:
                nbytes = rings[s](backend.to_host(st.flat_grads, out=host_grads[s]))
                copy_from_host(st.flat_grads, host_grads[s])
            else:
                nbytes = rings[s](st.flat_grads)
            recorder.record(KIND["allreduce"], step, s, -1, t0, Recorder.clock(), nbytes, ring_peer)
        for s, st in stages.items():
            t0 = Recorder.clock()
            optimizers[s].step(st.flat_grads)
            backend.synchronize()
            recorder.record(KIND["optimizer"], step, s, -1, t0, Recorder.clock())
        recorder.record(KIND["step"], step, -1, -1, t_step, Recorder.clock())
        for s, n in result.peak_inflight.items():
            peak_inflight[s] = max(peak_inflight[s], n)
        # One small collective per step: the metrics, and whether any rank was told to stop
        # (agreed here, at a step boundary, never inside the signal handler).
        mine = np.array([result.loss_sum, result.correct, result.samples, preempt.requested])
        world.Allreduce(mine, step_sums, op=MPI.SUM)
        losses.append(float(step_sums[0] / (g.dp * M)))
        accuracies.append(float(step_sums[1] / max(step_sums[2], 1)))
        if not quiet and world.rank == 0:
            log.info(
                "step %d/%d  loss %.4f  train acc %.3f  %.1f ms",
                step + 1, t.steps, losses[-1], accuracies[-1], 1e3 * (Recorder.clock() - t_step),
            )  # fmt: skip
        every = job.checkpoint.every
        if step_sums[3] or (every and (step + 1) % every == 0):
            path = checkpoint.save_all(
                world, grid.dp_rank, job, step + 1, stages, optimizers, rings, losses, accuracies
            )
            if step_sums[3]:
                raise Preempted(step + 1, path)
    preempt.restore()
    runtime_s = Recorder.clock() - t_start
    step_rows = recorder.events[recorder.events["kind"] == KIND["step"]]
    # rank 0's own step durations; NaN for steps run before a resume
    step_times = np.concatenate([np.full(start, np.nan), step_rows["end"] - step_rows["start"]])

    test_accuracy = _evaluate(world, grid, stages, num_stages, task, job.model, backend)
    replica_diff = _replica_check(world, grid, stages)
    bytes_sent = _bytes_sent(world, runtime, rings)
    peaks = world.gather(peak_inflight, root=0)
    events = gather_events(world, recorder, offset - t_origin)
    hostnames = world.gather(socket.gethostname(), root=0)
    grid.free()  # a sweep calls train() many times in one process
    params = gather_parameters(world, grid, stages, num_stages) if collect_params else None
    if world.rank != 0:
        return None

    peak_by_stage = {s: n for d in peaks for s, n in d.items()}
    summary = Summary(
        steps=t.steps,
        runtime_s=runtime_s,
        samples_per_s=(t.steps - start) * t.global_batch / runtime_s if runtime_s > 0 else 0.0,
        losses=losses,
        accuracies=accuracies,
        test_accuracy=test_accuracy,
        bytes_sent=bytes_sent,
        replica_max_diff=replica_diff,
        peak_inflight=dict(sorted(peak_by_stage.items())),
        grid_as_run=grid_as_run(events, g.pp, v, t.steps - 1) if t.steps > start else "",
        params=params,
        events=events,
    )
    if job.trace.path:
        write_trace(
            job.trace.path,
            events=events,
            steps={
                "loss": np.array(losses),
                "accuracy": np.array(accuracies),
                "step_time": step_times,
            },
            config=to_toml(job),
            attrs=_run_attrs(world, job, summary, hostnames),
            overwrite=job.trace.overwrite,
        )
        summary.trace_path = job.trace.path
    return summary


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
