"""What a pipeline step pays besides its F, B and W, measured at the start as the runtime pays it:
the message hop of one activation and a rank's gap between two compute actions. A schedule search
on the job's timed blocks (train.schedule = "auto") adds them, so an order with more actions or
more hops (a V placement has twice both) pays for them as the run will.

    send, gap = probe_link(world, job)       # collective over world; rank 0's figures (0 elsewhere)

Pipeline ranks 0 and 1 of replica 0 run the runtime itself (pipeline.runtime, zb-h1 at the job's
M, the job's activation shape and send mode, PROBE_STEPS steps) on stages whose passes are a
fixed GEMM and a copy of their tensor, so each step is that work, the runtime's own bookkeeping
and its messages; the hop and the gap are then read from its trace rows by the rules the
simulator applies them with (analysis.messages.message_latency, the median: a typical hop, not
the scheduler's stalls; analysis.costs.stage_costs' gap). The first step is a warm-up. Ranks
other than those two return at once. A rank waiting in MPI on a loaded machine pays the
scheduler's tick to get its core back: the hop then reads milliseconds (docs/schedules.md).
"""

from __future__ import annotations

import numpy as np

PROBE_STEPS = 6  # steps run (the first left out)
WORK = 384  # each pass's GEMM is WORK x WORK x WORK


class _CopyStage:
    """A stage that passes its tensor on (the last one: two logits per sample) after a fixed
    GEMM (WORK: about a millisecond, so both ranks compute as in a run and sit on a core each),
    so a step of the runtime is that work, its bookkeeping and its messages."""

    def __init__(self, last: bool):
        self.last = last
        self.a = np.full((WORK, WORK), 1e-3, np.float32)

    def _work(self) -> None:
        np.dot(self.a, self.a)

    def forward(self, x: np.ndarray):
        self._work()
        y = x.reshape(len(x), -1)[:, :2].copy() if self.last else x.copy()
        return y, x.shape

    def backward_input(self, dy, shape, need_dx: bool):
        self._work()
        return (np.zeros(shape, np.float32) if need_dx else None), None

    def backward_weight(self, wcache, hook=None) -> None:
        self._work()
        if hook is not None:
            hook(0)

    def backward(self, dy, shape, need_dx: bool, hook=None):
        self.backward_weight(None, hook)
        return self.backward_input(dy, shape, need_dx)[0]

    def activation_nbytes(self, shape) -> int:
        return 0


def activation_shape(job) -> tuple[int, ...]:
    """One micro-batch's activation crossing the first pipeline boundary of an even split (the
    job's own may not be resolved yet: "timed"), float32."""
    import dataclasses

    from mpihybrid.nn.data import task_dims
    from mpihybrid.nn.model import boundary_shapes

    model = dataclasses.replace(job.model, partition="uniform")
    chunks = max(2, job.grid.pp)
    return boundary_shapes(model, *task_dims(job.data), chunks, job.microbatch_size)[1]


def probe_link(world, job) -> tuple[float, float]:
    """(send, gap) seconds measured on pipeline ranks 0 and 1 of replica 0 (module text);
    (0.0, 0.0) at pp = 1, with no world, and on every other rank. Collective over `world`."""
    if world is None or job.grid.pp < 2:
        return 0.0, 0.0
    from mpi4py import MPI

    from mpihybrid.comm.layout import Layout

    layout = Layout(job.grid.pp, job.grid.dp, job.grid.order)
    pair = (layout.rank(0, 0), layout.rank(1, 0))
    rank = world.Get_rank()
    comm = world.Split(
        0 if rank in pair else MPI.UNDEFINED, pair.index(rank) if rank in pair else 0
    )
    if comm == MPI.COMM_NULL:
        return 0.0, 0.0
    try:
        rows = _run(comm, job)
    finally:
        comm.Free()
    if rank != pair[0]:
        return 0.0, 0.0
    return _read(rows)


def _run(comm, job) -> np.ndarray | None:
    """PROBE_STEPS steps of zb-h1 on copy stages; every rank's trace rows on rank 0."""
    from mpihybrid.pipeline.plan import make_schedule
    from mpihybrid.pipeline.runtime import PipelineRuntime
    from mpihybrid.pipeline.schedules import lower
    from mpihybrid.trace.recorder import Recorder, clock_offset, gather_events

    m, me = job.train.microbatches, comm.Get_rank()
    probe = make_schedule("zb-h1", 2, m, early_grad_send=True)
    placement = probe.placement
    lists = lower(probe.lists(), placement)
    shape = tuple(activation_shape(job))
    recorder = Recorder(me, replica=0, capacity=PROBE_STEPS * len(lists[me]) + 8)
    runtime = PipelineRuntime(
        comm,
        {me: _CopyStage(last=me == 1)},
        lists[me],
        job.runtime_settings(),
        placement=placement,
        shapes=[shape, shape],
        recorder=recorder,
    )
    x = np.ones(shape, np.float32)
    batches = [(x, np.zeros(len(x), np.int64)) for _ in range(m)]
    for step in range(PROBE_STEPS):
        runtime.run_step(step, batches)
    return gather_events(comm, recorder, clock_offset(comm))


def _read(rows: np.ndarray) -> tuple[float, float]:
    """(send, gap) of the probe's rows past its first step."""
    from mpihybrid.analysis.costs import stage_costs
    from mpihybrid.analysis.messages import message_latency

    rows = rows[rows["step"] >= 1]
    send = message_latency(rows)
    return send, float(stage_costs(rows, 2, send)["gap"])
