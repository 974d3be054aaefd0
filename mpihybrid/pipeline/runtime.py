"""Executes one rank's lowered action list for one training step.

    F s m       forward of stage s on micro-batch m (stage 0 reads data; the last adds the loss)
    B s m       backward (input gradient only when the schedule also has W s m)
    W s m       weight gradient of a split backward (zero-bubble)
    SEND_* s m  Isend (or Issend in sync mode) of the tensor F/B just produced, to the neighbour
    RECV_* s m  wait for a receive that was posted when the step began

Every receive of the step is posted up front into a preallocated buffer, so a send never waits on
the receiver reaching its RECV: deadlock-freedom does not rest on MPI's eager buffering, which the
sync mode (Issend everywhere) demonstrates. Tensors go through uppercase buffer calls only, and
through the backend's MPI buffers: on a GPU without CUDA-aware MPI those are persistent host
copies (device.Backend), and a received tensor is copied to the device when its RECV completes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.device import CPU, Backend
from mpihybrid.nn.layers import SoftmaxCrossEntropy
from mpihybrid.pipeline.schedules import Action, stage_rank
from mpihybrid.trace.recorder import KIND, Recorder

# b = micro-batch size; shapes of the tensors crossing each stage boundary come from the model


def tag_for(kind: str, stage: int, microbatch: int, num_microbatches: int) -> int:
    """The one message tag: which tensor (activation or gradient), of which stage and micro-batch.

    `stage` is the *sending* stage. Tags need no step number: every message of a step completes
    before the next step starts.
    """
    return (2 * stage + (kind == "B")) * num_microbatches + microbatch


@dataclass
class StepResult:
    loss_sum: float  # sum over my micro-batches of their mean loss (last stage only)
    correct: int
    samples: int
    peak_inflight: dict[int, int]  # stage -> most activations alive at once this step
    peak_activation_bytes: int


class PipelineRuntime:
    def __init__(
        self,
        pp_comm: MPI.Comm,
        stages: dict,  # global stage index -> Stage, for the chunks this rank owns
        actions: list[Action],
        num_stages: int,
        num_microbatches: int,
        boundary_shapes: list[tuple[int, ...]],  # input shape of stage s, for s in 0..num_stages-1
        recorder: Recorder,
        sync_sends: bool = False,
        backend: Backend = CPU,
    ):
        self.comm = pp_comm
        self.pp_rank, self.pp_size = pp_comm.Get_rank(), pp_comm.Get_size()
        self.stages, self.actions = stages, actions
        self.num_stages, self.num_microbatches = num_stages, num_microbatches
        self.v = num_stages // self.pp_size
        self.recorder = recorder
        self.backend = backend
        self.isend = pp_comm.Issend if sync_sends else pp_comm.Isend
        self.loss_fn = SoftmaxCrossEntropy()
        self.bytes_sent = {"activation": 0, "activation_grad": 0}
        # traces name peers by world rank
        world_group, pp_group = MPI.COMM_WORLD.Get_group(), pp_comm.Get_group()
        self.world_rank = pp_group.Translate_ranks(list(range(self.pp_size)), world_group)
        pp_group.Free()
        world_group.Free()
        self.cache_nbytes: dict[int, int] = {}  # stage -> bytes one forward cache holds
        self.split_backward = {(a.stage, a.microbatch) for a in actions if a.kind == "W"}
        top = tag_for("B", num_stages - 1, num_microbatches - 1, num_microbatches)
        tag_ub = pp_comm.Get_attr(MPI.TAG_UB)
        if tag_ub is not None and top > tag_ub:
            raise ValueError(f"message tag {top} exceeds this MPI's TAG_UB {tag_ub}")
        # One preallocated receive buffer per RECV action, reused every step.
        self.recv_buffers: dict[tuple[str, int, int], np.ndarray] = {}
        for a in actions:
            if a.kind == "RECV_F":
                shape = boundary_shapes[a.stage]
            elif a.kind == "RECV_B":
                shape = boundary_shapes[a.stage + 1]
            else:
                continue
            self.recv_buffers[(a.kind[-1], a.stage, a.microbatch)] = backend.empty(
                shape, np.float32
            )

    def _is_local(self, stage: int) -> bool:
        return (
            0 <= stage < self.num_stages and stage_rank(stage, self.pp_size, self.v) == self.pp_rank
        )

    def run_step(self, step: int, batches: list[tuple[np.ndarray, np.ndarray]]) -> StepResult:
        """Run my action list once over `batches` (my replica's M micro-batches)."""
        M, last = self.num_microbatches, self.num_stages - 1
        rec, clock, backend = self.recorder, Recorder.clock, self.backend
        # a GPU queues kernels: wait for them so the trace times the work, not its launch
        settle = backend.synchronize  # a no-op on the CPU
        scale = 1.0 / M  # each micro-batch's mean loss counts 1/M of the step's loss
        # Post every receive of the step before computing anything.
        pending_recv = {}
        for key, buf in self.recv_buffers.items():
            kind, stage, mb = key
            src_stage = stage - 1 if kind == "F" else stage + 1
            src = stage_rank(src_stage, self.pp_size, self.v)
            pending_recv[key] = self.comm.Irecv(
                [backend.mpi_recv_buffer(buf, key), MPI.FLOAT],
                source=src,
                tag=tag_for(kind, src_stage, mb, M),
            )
        inbox: dict[tuple[str, int, int], np.ndarray] = {}  # tensors ready to consume
        outbox: dict[tuple[str, int, int], np.ndarray] = {}  # tensors produced, not yet sent
        caches, wcaches, activation_bytes = {}, {}, {}
        send_requests = []
        loss_sum, correct = 0.0, 0
        inflight = {s: 0 for s in self.stages}
        peak = dict(inflight)
        live_bytes = peak_bytes = 0
        for a in self.actions:
            s, mb, kind = a.stage, a.microbatch, a.kind
            t0 = clock()
            if kind == "F":
                x = batches[mb][0] if s == 0 else inbox.pop(("F", s, mb))
                y, cache = self.stages[s].forward(x)
                if s == last:
                    loss, lcache = self.loss_fn.forward(y, batches[mb][1])
                    loss_sum += loss
                    correct += self.loss_fn.correct(lcache)
                    inbox[("B", s, mb)] = self.loss_fn.backward(lcache, scale)
                else:
                    (inbox if self._is_local(s + 1) else outbox)[("F", s + 1, mb)] = y
                caches[(s, mb)] = cache
                if s not in self.cache_nbytes:  # shapes are fixed: walk one cache per stage
                    self.cache_nbytes[s] = self.stages[s].activation_nbytes(cache)
                nbytes = activation_bytes[(s, mb)] = self.cache_nbytes[s]
                live_bytes += nbytes
                peak_bytes = max(peak_bytes, live_bytes)
                inflight[s] += 1
                peak[s] = max(peak[s], inflight[s])
                settle()
                rec.record(KIND["forward"], step, s, mb, t0, clock(), nbytes)
            elif kind == "B":
                dy = inbox.pop(("B", s, mb))
                cache = caches.pop((s, mb))
                need_dx = s > 0
                if (s, mb) in self.split_backward:
                    dx, wcaches[(s, mb)] = self.stages[s].backward_input(dy, cache, need_dx)
                else:
                    dx = self.stages[s].backward(dy, cache, need_dx)
                    inflight[s] -= 1
                    live_bytes -= activation_bytes.pop((s, mb))
                if s > 0:
                    (inbox if self._is_local(s - 1) else outbox)[("B", s - 1, mb)] = dx
                settle()
                rec.record(KIND["backward"], step, s, mb, t0, clock())
            elif kind == "W":
                wcache = wcaches.pop((s, mb))
                self.stages[s].backward_weight(wcache)
                inflight[s] -= 1
                live_bytes -= activation_bytes.pop((s, mb))
                settle()
                rec.record(KIND["weight"], step, s, mb, t0, clock())
            elif kind in ("SEND_F", "SEND_B"):
                fb = kind[-1]
                dst_stage = s + 1 if fb == "F" else s - 1
                buf = outbox.pop((fb, dst_stage, mb))
                tag = tag_for(fb, s, mb, M)
                wire = backend.mpi_send_buffer(buf, (fb, s, mb))
                send_requests.append(self.isend([wire, MPI.FLOAT], dest=a.peer, tag=tag))
                self.bytes_sent["activation" if fb == "F" else "activation_grad"] += buf.nbytes
                peer = self.world_rank[a.peer]
                rec.record(KIND["send"], step, s, mb, t0, clock(), buf.nbytes, peer)
            elif kind in ("RECV_F", "RECV_B"):
                key = (kind[-1], s, mb)
                pending_recv.pop(key).Wait()
                backend.finish_recv(self.recv_buffers[key], key)
                inbox[key] = self.recv_buffers[key]
                peer = self.world_rank[a.peer]
                rec.record(KIND["recv"], step, s, mb, t0, clock(), inbox[key].nbytes, peer)
            else:
                raise ValueError(f"unknown action {a}")
        t0 = clock()
        MPI.Request.Waitall(send_requests)
        if send_requests:
            rec.record(KIND["send"], step, -1, -1, t0, clock())
        assert not pending_recv and not caches and not wcaches, "action list left work undone"
        # what the accuracy counts: samples (mlp) or predicted tokens (gpt)
        samples = sum(b[1].size for b in batches) if last in self.stages else 0
        return StepResult(loss_sum, correct, samples, peak, peak_bytes)


def forward_only(
    pp_comm: MPI.Comm,
    stages: dict,
    num_stages: int,
    x: np.ndarray,
    boundary_shapes: list[tuple[int, ...]],
    backend: Backend = CPU,
) -> np.ndarray | None:
    """Push one batch through the whole pipeline (evaluation); the last stage's rank gets logits."""
    pp_rank, pp_size = pp_comm.Get_rank(), pp_comm.Get_size()
    v = num_stages // pp_size
    for s in range(num_stages):
        owner = stage_rank(s, pp_size, v)
        if owner != pp_rank:
            continue
        if s > 0:
            prev = stage_rank(s - 1, pp_size, v)
            if prev != pp_rank:
                x = backend.empty(boundary_shapes[s], np.float32)
                key = ("eval", s, x.shape)  # a staging buffer per boundary and piece size
                pp_comm.Recv([backend.mpi_recv_buffer(x, key), MPI.FLOAT], source=prev, tag=s)
                backend.finish_recv(x, key)
        x, _ = stages[s].forward(x)
        if s < num_stages - 1:
            nxt = stage_rank(s + 1, pp_size, v)
            if nxt != pp_rank:
                x = backend.xp.ascontiguousarray(x)
                wire = backend.mpi_send_buffer(x, ("eval", s + 1, x.shape))
                pp_comm.Send([wire, MPI.FLOAT], dest=nxt, tag=s + 1)
    last_owner = stage_rank(num_stages - 1, pp_size, v)
    return x if pp_rank == last_owner else None
