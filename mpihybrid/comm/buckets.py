"""Gradients reduced in buckets as soon as the backward has finished them, behind the compute.

    comm = GradientComm(dp_comm, settings)    # one per rank, shared by its stages (comm.settings)
    red = comm.reducer(s, stage.flat_grads, stage.param_ranges)
    red.bind(optimizer)       # once: a reduced bucket [lo, hi) is optimizer.update(grads, lo, hi)
    red.begin_step()          # every step, after optimizer.begin_step()
    red.ready_from(lo)        # the backward finished every gradient of the stage at offsets >= lo
    comm.poll()               # (progress="poll") move the rings on between two actions
    events = comm.finish()    # the rest, blocking: every bucket reduced and updated

A stage's flat gradient is cut into buckets on layer boundaries, from the end: the backward runs
from the last layer to the first, so the last bucket is final first (Megatron's
overlap_grad_reduce and DDP's buckets work the same way). When the stage's last backward (W for
zero-bubble lists) has passed a bucket's first layer, the bucket's ring all-reduce starts while
the rank computes on, and the optimizer updates the bucket's slice of the parameters as soon as
its reduction is done. Elementwise optimizers give the same bits per slice as over the whole
buffer, and the ring's result does not depend on when it runs, so overlap changes timing only.

Distributed optimizer (train.shard_optimizer, ZeRO-1): a bucket's ring runs its reduce-scatter
only; this rank updates the chunk of the bucket it owns (its optimizer state covers those chunks
alone), then a second ring of the weights' codec (comm.param_codec) all-gathers the updated
parameters. Update and gather start as soon as the bucket's reduce-scatter is done, behind the
compute like the rest.

    comm = GradientComm(dp_comm, GradientSettings(ring, weights=RingSettings(param_codec)))
    red = comm.reducer(s, flat_grads, param_ranges, flat_params=p, tensor_offsets=offsets)
    red.owned                 # [(lo, hi)] per bucket: the flat offsets this rank updates
    red.bind(sharded_optimizer)      # its master_of(lo, hi): the owner's fp32 weights, or None

Across nodes (comm.ring): `GradientComm(..., groups=NodeGroups(dp_comm, nodes))` makes every
bucket's ring the two-level ring of comm.hier_ring (inside each node, across, inside again)
instead of one flat ring over dp_comm; `ring_kind(setting, nodes)` says which one a setting
gives a dp group.

Progress (comm.overlap):
    thread  a communication thread per rank runs the rings (MPI_THREAD_MULTIPLE; mpi4py releases
            the GIL in MPI calls and the codec kernels release it too) and the optimizer
    poll    the rings are generators of requests; the runtime tests them between actions
    off     nothing starts before the pipeline has finished: every bucket after the step
Every replica of a stage runs the same action list, so buckets reach the ring in the same order
on every replica (stages of one rank share dp_comm: one queue keeps their order too).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.allreduce import RingAllreduce
from mpihybrid.comm.device import array_module
from mpihybrid.comm.hier_ring import NodeGroups, TwoLevelRing
from mpihybrid.comm.settings import GradientSettings, RingSettings

RINGS = ("auto", "flat", "hierarchical")
DEFAULTS = GradientSettings()  # fp32 rings, 4 MiB buckets, a communication thread


def ring_kind(setting: str, nodes: list[int] | None) -> tuple[str, str]:
    """The ring a dp group whose ranks sit on `nodes` (one per dp rank; None: unknown) gets for
    comm.ring = setting, and a warning ("" when none): "hierarchical" where the group spans
    nodes and two of its ranks share one (auto or asked for), else "flat"."""
    if setting not in RINGS:
        raise ValueError(f"comm.ring = {setting!r}: choose one of {', '.join(RINGS)}")
    spans = nodes is not None and len(set(nodes)) > 1
    shares = nodes is not None and len(set(nodes)) < len(nodes)  # two replicas on one node
    if setting == "flat" or (setting == "auto" and not (spans and shares)):
        return "flat", ""
    if nodes is None:
        why = "MPI cannot say which ranks share a node"
    elif not spans:
        why = "this stage's replicas share one node"
    elif not shares:
        why = "one replica a node: the two levels are one"
    else:
        return "hierarchical", ""
    return "flat", f"comm.ring = 'hierarchical': {why}: the flat ring"


def bucket_ranges(param_ranges: list[tuple[int, int]], bucket_bytes: int) -> list[tuple[int, int]]:
    """Buckets [lo, hi) over the flat buffer in the order the backward finishes them (from the
    end), each a run of whole layers of at least `bucket_bytes` (float32) but the last."""
    ranges = [r for r in param_ranges if r[1] > r[0]]  # layers with parameters, in buffer order
    buckets: list[tuple[int, int]] = []
    hi = None
    for lo, end in reversed(ranges):
        hi = end if hi is None else hi
        if 4 * (hi - lo) >= bucket_bytes:
            buckets.append((lo, hi))
            hi = None
    if hi is not None:
        buckets.append((ranges[0][0], hi))
    return buckets


@dataclass
class BucketEvent:
    """What one bucket did, for the trace (recorded on the main thread)."""

    stage: int
    bucket: int
    start: float  # the ring started
    reduced: float  # the ring ended, the update started
    end: float  # the update ended
    nbytes: int
    gathered: float = 0.0  # sharded: the weight all-gather ended (it began at `end`)
    gather_nbytes: int = 0
    held: float = 0.0  # a held bucket (train.grad_clip): the update started (0: at `reduced`)


class Reducer:
    """One stage's gradient: its buckets, their rings, and which are final this step."""

    def __init__(
        self,
        owner: GradientComm,
        stage: int,
        flat_grads: np.ndarray,
        param_ranges: list[tuple[int, int]],
        *,
        flat_params: np.ndarray | None = None,
        tensor_offsets: tuple[int, ...] = (),
    ) -> None:
        """Rings of owner.settings; sharded (settings.weights set): the weights (flat_params)
        gathered in segments that end where a tensor does (tensor_offsets: where each starts)."""
        self.owner, self.stage, self.flat_grads = owner, stage, flat_grads
        self.flat_params = flat_params
        settings = owner.settings
        self.backend = settings.ring.backend
        n = flat_grads.size
        self.buckets = bucket_ranges(param_ranges, settings.bucket_bytes) if n else []
        # one residual for the stage (what checkpoints keep); each ring works on its slice
        lossy = settings.ring.codec.lossy and settings.ring.error_feedback
        self.residual = self.backend.zeros(n, np.float32) if lossy else None
        role = "reduce_scatter" if settings.sharded else "allreduce"
        self.rings = [
            owner.ring(hi - lo, settings.ring, role, residual=self._residual(lo, hi))
            for lo, hi in self.buckets
        ]
        # sharded: the weight rings, and the flat offsets this rank owns in each bucket
        self.param_rings = None
        if settings.sharded:
            self.param_rings = [
                owner.ring(
                    hi - lo,
                    settings.weights,
                    "all_gather",
                    cuts=tuple(x - lo for x in tensor_offsets if lo < x < hi),
                )
                for lo, hi in self.buckets
            ]
        self.owned = [
            (lo + ring.own_range[0], lo + ring.own_range[1])
            for (lo, _), ring in zip(self.buckets, self.rings, strict=True)
        ]
        self.optimizer = None  # what updates a reduced bucket's parameters (bind)
        self.submitted = 0  # buckets handed to the ring this step
        # hold: a reduced bucket waits for release() instead of updating at once (train.grad_clip:
        # the update needs the norm over every bucket of every stage); meanwhile its sum of
        # squares is taken as its ring ends, behind the compute (sum_of_squares)
        self.hold = False
        self.sumsq = [0.0] * len(self.buckets)
        # gated: the last bucket (the stage's first layers) waits for open_gate() every step
        # before its ring (model.tie_embeddings: the head's gradient is added to the table's)
        self.gated = False
        self.gate_open = True

    def _residual(self, lo: int, hi: int) -> np.ndarray | None:
        return None if self.residual is None else self.residual[lo:hi]

    @property
    def bytes_sent(self) -> dict[str, int]:
        total = {"reduce_scatter": 0, "all_gather": 0}
        for ring in self.rings + (self.param_rings or []):
            for kind, nbytes in ring.bytes_sent.items():
                total[kind] = total.get(kind, 0) + nbytes
        return total

    @property
    def sharded(self) -> bool:
        return self.param_rings is not None

    @property
    def lossy_gather(self) -> bool:
        """Whether the weight gather quantises (the owner then keeps an fp32 master copy)."""
        return self.sharded and any(ring.compress for ring in self.param_rings)

    def bind(self, optimizer) -> None:
        """Once, when the stage's optimizer is made: a reduced bucket's parameters [lo, hi)
        (sharded: this rank's chunk of it) are optimizer.update(flat_grads, lo, hi); sharded,
        optimizer.master_of(lo, hi) are the owner's fp32 weights there, which the gather sends."""
        self.optimizer = optimizer

    def begin_step(self) -> None:
        """A new step: no bucket handed to the ring yet (the optimizer began its step)."""
        self.submitted = 0
        self.gate_open = not self.gated

    def open_gate(self) -> None:
        """After the step's backwards: the gated bucket's gradient is complete, and it goes to
        the ring (with any other bucket not yet there)."""
        self.gate_open = True
        self.ready_from(0)

    def update(self, lo: int, hi: int) -> None:
        """The optimizer on the reduced gradient's [lo, hi), where the parameters live (on a GPU
        its kernels finish before the trace's clock reads the end)."""
        self.optimizer.update(self.flat_grads, lo, hi)
        self.backend.synchronize()  # a no-op on the CPU

    def sum_of_squares(self, i: int) -> float:
        """The squared l2 norm of the reduced gradient of bucket i that this rank owns (its
        chunk when sharded; without sharding the replicas hold the same bits, and dp rank 0
        counts the whole bucket, the others nothing): a float32 dot (nan or inf when the bucket
        is not finite)."""
        if self.sharded:
            lo, hi = self.owned[i]
        elif self.owner.dp_comm.Get_rank() == 0:
            lo, hi = self.buckets[i]
        else:
            return 0.0
        g = self.flat_grads[lo:hi]
        return float(array_module(g).dot(g, g)) if hi > lo else 0.0

    def bucket_steps(self, i: int, times: list[float]) -> Iterator[MPI.Request]:
        """Bucket i as a generator of requests: reduce, update (and, sharded, gather the
        weights); `times` gets the clock when the reduction, the update (and the gather) end."""
        lo, hi = self.buckets[i]
        clock = time.perf_counter  # the trace's clock (trace.Recorder.clock)
        ring = self.rings[i]
        if self.param_rings is None:
            yield from ring.steps(self.flat_grads[lo:hi], "mean")
            times.append(clock())
            if self.hold:
                self.sumsq[i] = self.sum_of_squares(i)
            else:
                self.update(lo, hi)
            times.append(clock())
            return
        yield from ring.reduce_scatter_steps(self.flat_grads[lo:hi], "mean")
        times.append(clock())
        if self.hold:  # update and gather come with release()
            self.sumsq[i] = self.sum_of_squares(i)
            times += [clock(), clock()]
            return
        yield from self._update_and_gather(i, times)

    def _update_and_gather(self, i: int, times: list[float]) -> Iterator[MPI.Request]:
        """Sharded: update this rank's chunk of bucket i, then all-gather the bucket's weights."""
        clock = time.perf_counter
        lo, hi = self.buckets[i]
        olo, ohi = self.owned[i]
        if ohi > olo:
            self.update(olo, ohi)
        times.append(clock())
        master = self.optimizer.master_of(olo, ohi)
        gather = self.param_rings[i].gather_steps(self.flat_params[lo:hi], master)
        yield from gather
        times.append(clock())

    def release(self, i: int) -> tuple[float, float, int]:
        """A held bucket i: its update (sharded: and the weight gather, blocking); returns when
        the update ended, when the gather ended, and the gather's bytes."""
        times: list[float] = []
        if self.param_rings is None:
            lo, hi = self.buckets[i]
            self.update(lo, hi)
            end = time.perf_counter()
            return end, end, 0
        for request in self._update_and_gather(i, times):
            request.Wait()
        return times[0], times[1], self.param_rings[i].last_sent

    def _event(self, i: int, start: float, times: list[float]) -> BucketEvent:
        reduced, end = times[0], times[1]
        sent = self.rings[i].last_sent
        if self.param_rings is None:
            return BucketEvent(self.stage, i, start, reduced, end, sent, end, 0)
        gathered = 0 if self.hold else self.param_rings[i].last_sent  # hold: release() says
        return BucketEvent(self.stage, i, start, reduced, end, sent, times[2], gathered)

    def ready_from(self, lo: int) -> None:
        """Every gradient at offsets >= lo is final for this step: start the buckets it covers."""
        if self.owner.progress == "off":
            return
        limit = len(self.buckets) - (not self.gate_open)
        while self.submitted < limit and self.buckets[self.submitted][0] >= lo:
            self.owner.submit(self, self.submitted)
            self.submitted += 1

    def close(self) -> None:
        """Free the rings' shared windows (collective over dp_comm: every replica of the stage
        calls it at a normal end): the gradient rings and the weight gathers'."""
        for ring in self.rings + (self.param_rings or []):
            ring.close()

    def run_bucket(self, i: int, wait: Callable[[MPI.Request], None]) -> BucketEvent:
        """Reduce bucket i (each request through `wait`), then update its parameters."""
        start, times = time.perf_counter(), []
        for request in self.bucket_steps(i, times):
            wait(request)
        return self._event(i, start, times)


class GradientComm:
    """The rank's gradient communication: its reducers and how their rings make progress."""

    def __init__(
        self,
        dp_comm: MPI.Comm,
        settings: GradientSettings = DEFAULTS,
        *,
        groups: NodeGroups | None = None,
    ) -> None:
        """settings: the buckets' rings, their size and progress (comm.settings; its ring's
        backend: where the gradients live, a GPU's rings encode on the device and MPI sees only
        the encoded bytes). groups: the dp group's nodes, for two-level rings (comm.hier_ring);
        None: flat rings."""
        progress = settings.progress
        if progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            progress = "poll"  # this MPI cannot take calls from two threads at once
        self.dp_comm, self.settings, self.progress = dp_comm, settings, progress
        self.groups = groups
        self.reducers: dict[int, Reducer] = {}  # by stage, in the order they were made
        self.events: list[BucketEvent] = []
        self._todo: list[tuple[Reducer, int]] = []  # poll: queued, not started
        self._current: tuple | None = None  # poll: (red, i, steps, request, start, times)
        self._thread: _Worker | None = None

    def reducer(
        self,
        stage: int,
        flat_grads: np.ndarray,
        param_ranges: list[tuple[int, int]],
        *,
        flat_params: np.ndarray | None = None,
        tensor_offsets: tuple[int, ...] = (),
    ) -> Reducer:
        """Stage `stage`'s buckets; sharded (settings.weights): the distributed optimizer
        (module docstring), whose weight gather writes flat_params."""
        red = Reducer(
            self,
            stage,
            flat_grads,
            param_ranges,
            flat_params=flat_params,
            tensor_offsets=tensor_offsets,
        )
        self.reducers[stage] = red
        return red

    def ring(
        self,
        count: int,
        settings: RingSettings,
        role: str,
        *,
        residual: np.ndarray | None = None,
        cuts: tuple[int, ...] = (),
    ) -> RingAllreduce | TwoLevelRing:
        """One bucket's ring over dp_comm: flat, or two-level when the group spans nodes."""
        if self.groups is None:
            return RingAllreduce(
                self.dp_comm, count, settings, residual=residual, role=role, cuts=cuts
            )
        return TwoLevelRing(self.groups, count, settings, residual=residual, role=role, cuts=cuts)

    def submit(self, red: Reducer, i: int) -> None:
        if self.progress == "thread":
            if self._thread is None:
                self._thread = _Worker()
            self._thread.put(red, i)
        else:
            self._todo.append((red, i))
            self.poll()

    def poll(self) -> None:
        """Move the queued rings on as far as they go without waiting (progress="poll")."""
        while True:
            if self._current is None:
                if not self._todo:
                    return
                red, i = self._todo.pop(0)
                times: list[float] = []
                steps = red.bucket_steps(i, times)
                self._current = (red, i, steps, None, time.perf_counter(), times)
            red, i, steps, request, start, times = self._current
            if request is not None and not request.Test():
                return
            request = next(steps, None)
            if request is not None:
                self._current = (red, i, steps, request, start, times)
                continue
            self.events.append(red._event(i, start, times))
            self._current = None

    def finish(self) -> list[BucketEvent]:
        """Submit what is left, wait until every bucket is reduced and updated; the step's
        bucket events (raises here what the communication thread raised)."""
        for red in self.reducers.values():
            if self.progress == "off":
                for i in range(len(red.buckets)):
                    self.events.append(red.run_bucket(i, MPI.Request.Wait))
                red.submitted = len(red.buckets)
            else:
                red.ready_from(0)
        if self._thread is not None:
            self.events.extend(self._thread.drain())
        while self._current is not None or self._todo:  # poll: the rest, blocking
            if self._current is not None and self._current[3] is not None:
                self._current[3].Wait()
            self.poll()
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    def free_groups(self) -> None:
        """Free the two-level rings' communicators (collective over dp_comm; after the rings'
        own close)."""
        if self.groups is not None:
            self.groups.free()
            self.groups = None


def patient_wait(request: MPI.Request) -> None:
    """Wait for `request` without spinning: MPI's Wait polls a core flat out, the core the
    rank's compute needs (one core per rank); test, then sleep, backing off to 0.5 ms."""
    delay = 20e-6
    while not request.Test():
        time.sleep(delay)  # releases the GIL and the core
        delay = min(2 * delay, 5e-4)


class _Worker:
    """The communication thread: runs submitted buckets in order, blocking in MPI (GIL free)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done: list[BucketEvent] = []
        self._error: BaseException | None = None
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name="mpihybrid-comm", daemon=True)
        self._thread.start()

    def put(self, red: Reducer, i: int) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put((red, i))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            red, i = item
            try:
                if self._error is None:  # after a failure, only drain the queue
                    self._done.append(red.run_bucket(i, patient_wait))
            except BaseException as error:  # handed to the main thread by drain()
                self._error = error
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def drain(self) -> list[BucketEvent]:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        done, self._done = self._done, []
        return done

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()
