"""What a run is built from, once per rank before its first step: the grid, the task, the chunks
this rank holds (StageState: layers, optimizer, reducer), its action list and the runtime that
executes it, the gradient communication, and the trace.

    run = build_run(job, world, backend)    # collective (the grid's communicators, the rings)
    run.release()                           # collective, at the end or an agreed stop
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.buckets import GradientComm, ring_kind
from mpihybrid.comm.device import Backend
from mpihybrid.comm.grid import ProcessGrid
from mpihybrid.comm.hier_ring import NodeGroups
from mpihybrid.comm.nodes import NodeMapError, node_map
from mpihybrid.config import ConfigError, Job
from mpihybrid.nn.data import build_task
from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.model import Stage, boundary_shapes, build_stage
from mpihybrid.pipeline.runtime import PipelineRuntime
from mpihybrid.pipeline.schedules import lower
from mpihybrid.pipeline.wire import P2PWire, encoded_peers
from mpihybrid.trace.recorder import Recorder
from mpihybrid.trace.stream import TraceStream
from mpihybrid.train import tie, vocab_build
from mpihybrid.train.flight import FlightRecorder
from mpihybrid.train.state import StageState, build_states
from mpihybrid.train.tracing import build_trace
from mpihybrid.train.watchdog import StopSignals, Watchdog

log = logging.getLogger("mpihybrid")


@dataclass
class Run:
    """What train() builds once on a rank and every step uses."""

    grid: ProcessGrid
    task: object  # nn.data: the samples, their shapes
    backend: Backend
    states: dict[int, StageState]  # global stage index -> the chunk this rank holds
    runtime: PipelineRuntime
    gradcomm: GradientComm  # the gradient buckets of every stage and how they make progress
    recorder: Recorder
    trace: TraceStream  # flushes the recorder's rows to the trace file as it goes
    ring_peer: int  # world rank the ring sends to (the trace's peer of an all-reduce)
    # what watches it, made before the build (train() hands them over after it)
    flight: FlightRecorder | None = None  # this rank's last actions and waits
    signals: StopSignals | None = None  # None: not the main thread (no signal handlers)
    watchdog: Watchdog | None = None
    peak_flops: float | None = None  # one rank's GEMM rate, for the step line's roofline %
    tie: tie.EmbeddingGroup | None = None  # model.tie_embeddings: this rank's part, if any
    shards: dict[int, Stage] | None = None  # model.vocab_parallel: this rank's share, a chunk

    @property
    def stages(self) -> dict[int, Stage]:
        """Global chunk index -> its layers and flat buffers: the runtime's stages (and the
        rank's vocabulary share, model.vocab_parallel)."""
        return {**self.runtime.stages, **(self.shards or {})}

    def release(self) -> None:
        """Collective, at a normal end or an agreed stop: the communication thread, the rings'
        shared windows and the grid's communicators. A window left to MPI_Finalize fails it on
        some fabrics (MPICH over OFI: "fabricclose failed ... Device or resource busy", exit 15);
        a sweep calls train() many times in one process."""
        self.gradcomm.close()
        for s in sorted(self.states):
            self.states[s].reducer.close()
        self.gradcomm.free_groups()
        self.grid.free()


def build_run(job: Job, world: MPI.Comm, backend: Backend) -> Run:
    """Collective: grid, task, this rank's chunks, its action list, runtime, rings, optimizers
    and trace."""
    g, t, c = job.grid, job.train, job.comm
    if g.order == "auto":
        raise ConfigError(
            "grid.order = 'auto' is chosen before training (predict.auto."
            "resolve_order, as the mpihybrid command does)"
        )
    on_host = backend.xp is np
    grid = ProcessGrid.build(world, g.layout)
    task = build_task(job.data)
    placement = job.schedule.placement
    num_stages = placement.num_stages
    compute = job.schedule.lists()
    if job.model.vocab_parallel:  # every rank's passes on its share of the vocabulary
        compute = vocab_build.with_passes(job, task, compute, placement)
    actions = lower(compute, placement)[grid.pp_rank]
    stages = {
        s: build_stage(job.model, task.in_features, task.num_classes, s, num_stages, seed=t.seed)
        for s in placement.stages_of(grid.pp_rank)
    }
    for st in stages.values():
        if job.model.init:  # the file was checked against the model (config.validate)
            model_kind(job.model.kind).weights.load(st, job.model)  # the stage's own blocks
        if not on_host:
            st.to_device(backend.asarray)  # initialised on the host: the same draws everywhere
        st.recompute = t.recompute == "full"
    shapes = boundary_shapes(
        job.model, task.in_features, task.num_classes, num_stages, job.microbatch_size
    )
    recorder, trace = build_trace(job, world, grid.dp_rank, len(actions))
    peer_ranks = grid.layout.pipeline_ranks(grid.dp_rank)
    try:
        nodes = node_map(world)  # collective: which ranks share a node (comm.nodes)
    except NodeMapError as exc:
        raise ConfigError(str(exc)) from None
    wire = P2PWire.build(
        c.p2p_codec, encoded_peers(c.p2p_codec_scope, world.Get_rank(), peer_ranks, nodes)
    )
    gradcomm = GradientComm(
        grid.dp_comm,
        job.gradient_settings(backend),
        groups=_node_groups(job, world, grid, nodes),
    )
    shards = vocab_build.share_chunks(job, task, grid, num_stages)  # {} unless vocab_parallel
    states = build_states(job, {**stages, **shards}, gradcomm)
    tied = None
    # the head bound to the table, or to its mirror (vocab_parallel: a share holds one matrix)
    if model_kind(job.model.kind).stages_tie(job.model):
        tied = tie.embedding_group(grid.pp_comm, states, placement, backend, job.model)
    runtime = PipelineRuntime(
        grid.pp_comm,
        stages,
        actions,
        job.runtime_settings(backend, wire),
        placement=placement,
        shapes=shapes,
        recorder=recorder,
        peer_ranks=peer_ranks,
        grads_final={s: st.reducer.ready_from for s, st in states.items()},
        poll=gradcomm.poll if gradcomm.progress == "poll" else None,
    )
    vocab_build.attach(runtime, shards, states, job=job, task=task, grid=grid)
    return Run(
        grid=grid,
        task=task,
        backend=backend,
        states=states,
        runtime=runtime,
        gradcomm=gradcomm,
        recorder=recorder,
        trace=trace,
        ring_peer=grid.replica_neighbour(+1),
        tie=tied,
        shards=shards,
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
        log.warning(
            "%s",
            warning
            or "comm.ring = 'hierarchical': a stage's replicas share one node: the flat ring there",
        )
    return NodeGroups(grid.dp_comm, dp_nodes) if kind == "hierarchical" else None
