"""Executes one rank's lowered action list for one training step.

    F s m       forward of stage s on micro-batch m (stage 0 reads data; the last adds the loss)
    B s m       backward (input gradient only when the schedule also has W s m)
    W s m       weight gradient of a split backward (zero-bubble); W s m+n+..: merged, one pass
    SEND_* s m  Isend (or Issend in sync mode) of the tensor F/B just produced, to the neighbour
    RECV_* s m  wait for a receive that was posted when the step began

Every receive of the step is posted up front into a preallocated buffer, so a send never waits on
the receiver reaching its RECV: deadlock-freedom does not rest on MPI's eager buffering, which the
sync mode (Issend everywhere) demonstrates. Tensors go through uppercase buffer calls only, and
through the backend's MPI buffers: on a GPU without CUDA-aware MPI those are persistent host
copies (device.Backend), and a received tensor is copied to the device when its RECV completes.

A link that comm.p2p_codec encodes (pipeline.wire) sends the codec's bytes instead: the sender
encodes into a preallocated byte buffer per message, the receive is posted into a preallocated
byte buffer too, and its RECV decodes into the float32 buffer the stage reads. fp32 links are
untouched. bytes_sent and the trace count the bytes that went on the wire.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.device import CPU, Backend
from mpihybrid.pipeline.actions import last_weight_actions, split_backwards
from mpihybrid.pipeline.liveness import Liveness
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.schedules import Action, message_key
from mpihybrid.pipeline.slowdown import Slowdown
from mpihybrid.pipeline.vocab_passes import VOCAB_KINDS
from mpihybrid.pipeline.wire import P2PWire
from mpihybrid.progress import progress
from mpihybrid.trace.recorder import KIND, Recorder

COMPUTE_KINDS = frozenset("FBW")  # the actions whose thread CPU time is read

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


@dataclass(frozen=True)
class RuntimeSettings:
    """How the runtime runs every step (config.Job.runtime_settings makes it once)."""

    num_microbatches: int  # M, per replica per step (train.microbatches)
    loss: Callable[[], object]  # makes the last stage's loss: the model kind's (ModelKind.loss)
    sync_sends: bool = False  # Issend everywhere (comm.sync_sends): no reliance on eager buffers
    backend: Backend = field(default_factory=lambda: CPU)  # where the tensors live
    wire: P2PWire = field(default_factory=P2PWire)  # links that carry encoded tensors
    slowdown: Slowdown | None = None  # train.slowdown: a straggler made on purpose


class PipelineRuntime:
    def __init__(
        self,
        pp_comm: MPI.Comm,
        stages: dict,  # global stage index -> Stage, for the chunks this rank owns
        actions: list[Action],
        settings: RuntimeSettings,
        *,
        placement: Placement,
        shapes: list[tuple[int, ...]],  # input shape of stage s, for s in 0..num_stages-1
        recorder: Recorder,
        peer_ranks: list[int] | None = None,  # what the trace calls pp rank p; None: p itself
        grads_final: dict[int, Callable[[int], None]] | None = None,
        poll: Callable[[], None] | None = None,
        flight=None,
    ):
        """grads_final[stage](lo) (the stage's Reducer.ready_from): called during a stage's last
        weight-gradient action of the step, after each layer: the stage's gradients at flat
        offsets >= lo are final (the gradient buckets start on it). poll(): called between
        actions and while a receive is pending (rings that make progress by polling). flight:
        the rank's FlightRecorder (train.flight), told where each action begins and ends.
        settings.wire: which links carry encoded tensors, in which codec (pipeline.wire)."""
        num_microbatches, backend = settings.num_microbatches, settings.backend
        self.comm = pp_comm
        self.pp_rank, self.pp_size = pp_comm.Get_rank(), pp_comm.Get_size()
        self.stages, self.actions = stages, actions
        self.placement, self.num_microbatches = placement, num_microbatches
        self.num_stages = num_stages = placement.num_stages
        self.recorder = recorder
        slow = settings.slowdown
        self.slow = slow if slow is not None and slow.rank == recorder.rank else None
        # seconds, count and thread CPU seconds of each compute kind so far (train/
        # live_stragglers reads them). The CPU time tells a rank that waited for a core from one
        # that worked longer; a GPU's time is not the host thread's, so it is not read there.
        # A stage's last weight gradient is left out: the gradient rings and updates that run
        # inside it run on the replica whose ring ends last, not on every replica alike.
        self.kind_seconds = {k: [0.0, 0, 0.0] for k in "FBW"}
        self.cpu_clock = time.thread_time if backend.name == "cpu" else None
        self.cpu0 = float("nan")  # the thread's CPU clock when the running action started
        self.backend = backend
        self.isend = pp_comm.Issend if settings.sync_sends else pp_comm.Isend
        self.loss_fn = settings.loss()  # the model kind's (nn/kinds.py), on the last stage
        self.bytes_sent = {"activation": 0, "activation_grad": 0}
        # traces name peers by world rank: the caller knows how its pp_comm sits in the world
        self.peer_ranks = list(peer_ranks) if peer_ranks is not None else list(range(self.pp_size))
        self.cache_nbytes: dict[int, int] = {}  # stage -> bytes one forward cache holds
        self.split_backward = split_backwards(actions)
        self.last_weight_action = last_weight_actions(actions)
        self.grads_final, self.poll = grads_final, poll
        top = tag_for("B", num_stages - 1, num_microbatches - 1, num_microbatches)
        tag_ub = pp_comm.Get_attr(MPI.TAG_UB)
        if tag_ub is not None and top > tag_ub:
            raise ValueError(f"message tag {top} exceeds this MPI's TAG_UB {tag_ub}")
        # what executes each action kind (run_step looks it up per action)
        self._run = {"F": self._forward, "B": self._backward, "W": self._weight}
        self._run |= dict.fromkeys(("SEND_F", "SEND_B"), self._send)
        self._run |= dict.fromkeys(("RECV_F", "RECV_B"), self._recv)
        unknown = [a for a in actions if a.kind not in self._run and a.kind not in VOCAB_KINDS]
        if unknown:
            raise ValueError(f"unknown action {unknown[0]}")
        self.flight = flight
        self.vocab = None  # model.vocab_parallel: its VocabRuntime (attach_vocab)
        # what the flight record says of each action: kind, stage, mb, peer (world rank), tag
        self.flight_rows = [
            (
                a.kind,
                a.stage,
                a.microbatch,
                self.peer_ranks[a.peer] if a.peer >= 0 else -1,
                tag_for(*message_key(a), num_microbatches) if a.peer >= 0 else -1,
            )
            for a in actions
        ]
        self.wire = settings.wire
        self._allocate(actions, shapes)

    def attach_vocab(self, vocab) -> None:
        """model.vocab_parallel: the rank's share passes (E, S, T, G) run by `vocab`."""
        self.vocab = vocab
        self._run |= dict.fromkeys(VOCAB_KINDS, vocab.run)

    def _allocate(self, actions: list[Action], boundary_shapes: list[tuple[int, ...]]) -> None:
        """One preallocated receive buffer per RECV action, reused every step; an encoded link
        also has a byte buffer per RECV (what arrives) and per SEND (what leaves)."""
        backend = self.backend
        self.recv_buffers: dict[tuple[str, int, int], np.ndarray] = {}
        self.wire_buffers: dict[tuple[str, int, int], np.ndarray] = {}  # RECV's, SEND's (S...)
        for a in actions:
            if a.kind not in ("RECV_F", "RECV_B", "SEND_F", "SEND_B"):
                continue
            # a boundary's tensor: stage s's input; F of s sends s + 1's, B of s sends s's
            fb, sending = a.kind[-1], a.kind.startswith("SEND")
            shape = boundary_shapes[a.stage + (fb == "F" if sending else fb == "B")]
            key = (fb, a.stage, a.microbatch)
            if not sending:
                self.recv_buffers[key] = backend.empty(shape, np.float32)
            if self.wire.encodes(a.peer):
                nbytes = self.wire.codec_for(shape).nbytes(int(np.prod(shape)))
                self.wire_buffers[("S" + fb if sending else fb, *key[1:])] = backend.empty(
                    nbytes, np.uint8
                )

    def _is_local(self, stage: int) -> bool:
        return 0 <= stage < self.num_stages and self.placement.rank_of(stage) == self.pp_rank

    def run_step(self, step: int, batches: list[tuple[np.ndarray, np.ndarray]]) -> StepResult:
        """Run my action list once over `batches` (my replica's M micro-batches)."""
        state = _Step(step, batches, self._post_receives(), Liveness(self.split_backward))
        if self.vocab is not None:
            self.vocab.begin(state)
        run, clock, cpu = self._run, Recorder.clock, self.cpu_clock
        poll, flight, rows = self.poll, self.flight, self.flight_rows
        for j, a in enumerate(self.actions):
            if flight is not None:
                kind, stage, mb, peer, tag = rows[j]
                i = flight.begin(kind, step + 1, stage, mb, peer, tag)
            if cpu is not None and a.kind in COMPUTE_KINDS:
                self.cpu0 = cpu()
            run[a.kind](a, state, clock())
            if flight is not None:
                flight.end(i)
            if poll is not None:
                poll()
        t0 = Recorder.clock()
        if flight is not None:
            i = flight.begin("send wait", step + 1)
        MPI.Request.Waitall(state.send_requests)
        if flight is not None:
            flight.end(i)
        if state.send_requests:
            self.recorder.record(KIND["send"], step, -1, -1, t0, Recorder.clock())
        assert not (state.pending_recv or state.caches or state.wcaches), "action list left work"
        # what the accuracy counts: samples (mlp) or predicted tokens (gpt)
        samples = sum(b[1].size for b in batches) if self.num_stages - 1 in self.stages else 0
        peaks = {s: state.live.peak_count[s] for s in self.stages}
        return StepResult(
            state.loss_sum, state.correct, samples, peaks, state.live.peak_total_bytes
        )

    def _post_receives(self) -> dict:
        """Post every receive of the step before computing anything."""
        pending = {}
        for key, buf in self.recv_buffers.items():
            kind, stage, mb = key
            src_stage = stage - 1 if kind == "F" else stage + 1
            encoded = self.wire_buffers.get(key)
            target = [self.backend.mpi_recv_buffer(buf, key), MPI.FLOAT]
            if encoded is not None:
                target = [self.backend.mpi_recv_buffer(encoded, key), MPI.BYTE]
            pending[key] = self.comm.Irecv(
                target,
                source=self.placement.rank_of(src_stage),
                tag=tag_for(kind, src_stage, mb, self.num_microbatches),
            )
        return pending

    def _done(self, kind: str, a: Action, state: _Step, t0: float, nbytes: int = 0) -> None:
        # a GPU queues kernels: wait for them so the trace times the work, not its launch
        self.backend.synchronize()  # a no-op on the CPU
        letter = kind[0].upper()
        if self.slow is not None and self.cpu_clock is not None:  # in CPU time, as analyzed
            self.slow.after(letter, self.cpu_clock() - self.cpu0, self.cpu_clock)
        elif self.slow is not None:
            self.slow.after(letter, Recorder.clock() - t0)
        t1 = Recorder.clock()  # one reading: the kind's total and the trace row agree
        cpu = self.cpu_clock() - self.cpu0 if self.cpu_clock is not None else float("nan")
        k = 1 + len(a.merged)
        if self._grad_hook(letter, a.stage, a.microbatch) is None:
            total = self.kind_seconds[letter]
            total[0] += t1 - t0
            total[1] += k
            total[2] += cpu
        if k == 1:
            self.recorder.record(
                KIND[kind], state.step, a.stage, a.microbatch, t0, t1, nbytes, -1, cpu
            )
            return
        # a merged W: a row per micro-batch, its time and CPU time split evenly (the trace's
        # merge_w attribute says which W passes ran as one)
        edges = np.linspace(t0, t1, k + 1).tolist()
        for j, mb in enumerate(a.microbatches):
            row = (KIND[kind], state.step, a.stage, mb, edges[j], edges[j + 1], 0, -1, cpu / k)
            self.recorder.record(*row)

    def _forward(self, a: Action, state: _Step, t0: float) -> None:
        s, mb = a.stage, a.microbatch
        x = state.batches[mb][0] if s == 0 else state.inbox.pop(("F", s, mb))
        if s == 0 and self.vocab is not None:
            x = self.vocab.embedding(mb, state)  # the shares' parts of the token embedding
        y, cache = self.stages[s].forward(x)
        if s == self.num_stages - 1 and self.vocab is not None:
            self.vocab.head_input(mb, y, state)  # to every share's S
        elif s == self.num_stages - 1:
            # each micro-batch's mean loss counts 1/M of the step's loss
            scale = 1.0 / self.num_microbatches
            loss, right, dy = self.loss_fn.step(y, state.batches[mb][1], scale)
            state.loss_sum += loss
            state.correct += right
            state.inbox[("B", s, mb)] = dy
        else:
            (state.inbox if self._is_local(s + 1) else state.outbox)[("F", s + 1, mb)] = y
        state.caches[(s, mb)] = cache
        if s not in self.cache_nbytes:  # shapes are fixed: walk one cache per stage
            self.cache_nbytes[s] = self.stages[s].activation_nbytes(cache)
        state.live.step("F", s, mb, self.cache_nbytes[s])
        self._done("forward", a, state, t0, self.cache_nbytes[s])

    def _backward(self, a: Action, state: _Step, t0: float) -> None:
        s, mb = a.stage, a.microbatch
        vocab = self.vocab
        if vocab is not None and s == self.num_stages - 1:
            dy = vocab.head_grad(mb, state)  # the shares' parts, summed
        else:
            dy = state.inbox.pop(("B", s, mb))
        cache = state.caches.pop((s, mb))
        need_dx = s > 0 or vocab is not None  # the shares' rows of the table need it
        if (s, mb) in self.split_backward:
            dx, state.wcaches[(s, mb)] = self.stages[s].backward_input(dy, cache, need_dx)
        else:
            dx = self.stages[s].backward(dy, cache, need_dx, self._grad_hook("B", s, mb))
        state.live.step("B", s, mb)
        if s == 0 and vocab is not None:
            vocab.embedding_grad(mb, dx, state)
        elif s > 0:
            (state.inbox if self._is_local(s - 1) else state.outbox)[("B", s - 1, mb)] = dx
        self._done("backward", a, state, t0)

    def _grad_hook(self, kind: str, s: int, mb: int) -> Callable[[int], None] | None:
        """What the stage calls per layer when this action is its last weight gradient: its
        reducer's ready_from (none on the step's other actions)."""
        if self.grads_final is None or self.last_weight_action.get(s) != (kind, mb):
            return None
        return self.grads_final[s]

    def _weight(self, a: Action, state: _Step, t0: float) -> None:
        stage, hook = self.stages[a.stage], self._grad_hook("W", a.stage, a.microbatch)
        if a.merged:  # one GEMM per weight over every micro-batch's rows
            wcaches = [state.wcaches.pop((a.stage, mb)) for mb in a.microbatches]
            stage.backward_weight_merged(wcaches, hook)
            state.live.action(a)
        else:
            stage.backward_weight(state.wcaches.pop((a.stage, a.microbatch)), hook)
            state.live.step("W", a.stage, a.microbatch)
        self._done("weight", a, state, t0)

    def _send(self, a: Action, state: _Step, t0: float) -> None:
        s, mb, fb = a.stage, a.microbatch, a.kind[-1]
        buf = state.outbox.pop((fb, s + 1 if fb == "F" else s - 1, mb))
        tag = tag_for(fb, s, mb, self.num_microbatches)
        encoded = self.wire_buffers.get(("S" + fb, s, mb))
        if encoded is None:
            message = [self.backend.mpi_send_buffer(buf, (fb, s, mb)), MPI.FLOAT]
            nbytes = buf.nbytes
        else:  # encoded once, into this message's own bytes (kept until the step's Waitall)
            flat = self.backend.xp.ascontiguousarray(buf, dtype=np.float32).reshape(-1)
            self.wire.codec_for(buf.shape).encode(flat, encoded)
            message = [self.backend.mpi_send_buffer(encoded, (fb, s, mb)), MPI.BYTE]
            nbytes = encoded.nbytes
        state.send_requests.append(self.isend(message, dest=a.peer, tag=tag))
        self.bytes_sent["activation" if fb == "F" else "activation_grad"] += nbytes
        peer = self.peer_ranks[a.peer]
        self.recorder.record(KIND["send"], state.step, s, mb, t0, Recorder.clock(), nbytes, peer)

    def _recv(self, a: Action, state: _Step, t0: float) -> None:
        key = (a.kind[-1], a.stage, a.microbatch)
        request = state.pending_recv.pop(key)
        if self.poll is not None:  # keep the rings moving while the message is on its way
            while not request.Test():
                self.poll()
        request.Wait()
        buf, encoded = self.recv_buffers[key], self.wire_buffers.get(key)
        if encoded is None:
            self.backend.finish_recv(buf, key)
            nbytes = buf.nbytes
        else:  # decoded into the float32 buffer the stage reads
            self.backend.finish_recv(encoded, key)
            self.wire.codec_for(buf.shape).decode(encoded, buf.size, buf.reshape(-1))
            nbytes = encoded.nbytes
        state.inbox[key] = buf
        peer = self.peer_ranks[a.peer]
        self.recorder.record(
            KIND["recv"], state.step, a.stage, a.microbatch, t0, Recorder.clock(), nbytes, peer
        )


@dataclass
class _Step:
    """What one run_step keeps between actions."""

    step: int
    batches: list[tuple[np.ndarray, np.ndarray]]
    pending_recv: dict  # (F|B, stage, mb) -> the posted Irecv
    live: Liveness
    inbox: dict = field(default_factory=dict)  # tensors ready to consume
    outbox: dict = field(default_factory=dict)  # tensors produced, not yet sent
    caches: dict = field(default_factory=dict)  # (stage, mb) -> forward cache
    wcaches: dict = field(default_factory=dict)  # (stage, mb) -> cache of a split backward's W
    send_requests: list = field(default_factory=list)
    vocab: dict = field(default_factory=dict)  # model.vocab_parallel: VocabRuntime's messages
    loss_sum: float = 0.0
    correct: int = 0


def forward_only(
    pp_comm: MPI.Comm,
    stages: dict,
    placement: Placement,
    x: np.ndarray,
    boundary_shapes: list[tuple[int, ...]],
    *,
    backend: Backend = CPU,
    vocab=None,
) -> np.ndarray | None:
    """Push one batch through the whole pipeline (evaluation); the last stage's rank gets logits.
    Each stage's forward ticks the watchdog (an evaluation is many of these). vocab: the rank's
    VocabRuntime (model.vocab_parallel; every rank takes part)."""
    pp_rank, num_stages = pp_comm.Get_rank(), placement.num_stages
    rows_shape = x.shape
    if vocab is not None:
        x = vocab.eval_embed(x)
    for s in range(num_stages):
        if placement.rank_of(s) != pp_rank:
            continue
        if s > 0:
            prev = placement.rank_of(s - 1)
            if prev != pp_rank:
                x = backend.empty(boundary_shapes[s], np.float32)
                key = ("eval", s, x.shape)  # a staging buffer per boundary and piece size
                pp_comm.Recv([backend.mpi_recv_buffer(x, key), MPI.FLOAT], source=prev, tag=s)
                backend.finish_recv(x, key)
                progress("evaluation")
        x, _ = stages[s].forward(x)
        progress("evaluation")
        if s < num_stages - 1:
            nxt = placement.rank_of(s + 1)
            if nxt != pp_rank:
                x = backend.xp.ascontiguousarray(x)
                wire = backend.mpi_send_buffer(x, ("eval", s + 1, x.shape))
                pp_comm.Send([wire, MPI.FLOAT], dest=nxt, tag=s + 1)
    out = x if pp_rank == placement.rank_of(num_stages - 1) else None
    return out if vocab is None else vocab.eval_logits(out, rows_shape)
