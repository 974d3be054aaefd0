"""What a rank runs for its share of the vocabulary (model.vocab_parallel), for the runtime.

    vocab = VocabRuntime(pp_comm, shard, placement, num_microbatches, act_shape, ...)
    vocab.begin(state)               # the step's receives, posted before any compute
    vocab.run(action, state)         # an E, S, T or G action (pipeline/vocab_passes.py)
    x = vocab.embedding(mb, state)   # the first stage's F: the shares' parts, summed
    vocab.head_input(mb, h, state)   # the last stage's F: its output to every share
    dy = vocab.head_grad(mb, state)  # the last stage's B: the shares' parts of its gradient
    vocab.embedding_grad(mb, dx, state)  # the first stage's B: its input gradient to every share

Messages are non-blocking sends (waited at the step's end with the pipeline's) into receives
posted when the step begins, so a pass waits only for its inputs; sums over the shares run in rank
order (the same bits on every rank and every run). Evaluation: eval_embed and eval_logits
(collectives over pp_comm).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpihybrid.nn.vocab import STATS, combine
from mpihybrid.trace.recorder import KIND, Recorder

PART, HIDDEN, STAT, DHID, DEMB = range(5)  # what a message carries
RECORD = {"E": "vocab_embed", "S": "vocab_logits", "T": "vocab_grad", "G": "vocab_embed_grad"}


class VocabRuntime:
    def __init__(
        self,
        pp_comm,
        shard,
        placement,
        num_microbatches: int,
        act_shape: tuple[int, ...],
        *,
        recorder: Recorder,
        peer_ranks: list[int],
        isend,
        tag_base: int,
        grads_final=None,
        last_grad: int = -1,
    ) -> None:
        """shard: the nn.model.Stage holding this rank's VocabShard; act_shape (b, T, C);
        grads_final(lo): the shard's reducer, called after its last gradient pass (last_grad:
        that G's micro-batch)."""
        self.comm, self.shard, self.layer = pp_comm, shard, shard.layers[0]
        self.rank, self.pp = pp_comm.Get_rank(), pp_comm.Get_size()
        self.m, self.shape, self.recorder, self.isend = num_microbatches, act_shape, recorder, isend
        self.peer_ranks, self._ready = peer_ranks, 0.0  # world rank of each pp rank
        self.first = placement.rank_of(0)
        self.head = placement.rank_of(placement.num_stages - 1)
        self.base, self.grads_final, self.last_grad = tag_base, grads_final, last_grad
        self.others = [r for r in range(self.pp) if r != self.rank]
        rows = int(np.prod(act_shape[:-1]))
        wants = []  # (what, source) of every message this rank receives, per micro-batch
        if self.rank == self.first:
            wants += [(PART, r) for r in self.others]
        else:
            wants.append((DEMB, self.first))
        if self.rank == self.head:
            wants += [(DHID, r) for r in self.others]
        else:
            wants.append((HIDDEN, self.head))
        wants += [(STAT, r) for r in self.others]
        shape = {PART: act_shape, HIDDEN: act_shape, DHID: act_shape, DEMB: act_shape}
        shape[STAT] = (STATS, rows)
        self.buffers = {
            (w, r, mb): np.empty(shape[w], np.float32) for w, r in wants for mb in range(self.m)
        }
        self.run_pass = {
            "E": self._embed,
            "S": self._logits,
            "T": self._grad,
            "G": self._embed_grad,
        }

    def tag(self, what: int, mb: int) -> int:
        return self.base + what * self.m + mb

    # ---- the step

    def begin(self, state) -> None:
        state.vocab = {"pending": {}, "local": {}}
        for (what, src, mb), buf in self.buffers.items():
            req = self.comm.Irecv([buf, MPI.FLOAT], source=src, tag=self.tag(what, mb))
            state.vocab["pending"][(what, src, mb)] = req

    def _take(self, state, what: int, src: int, mb: int) -> np.ndarray:
        """What `src` sent for mb (waited for: a recv row of the trace, as the pipeline's)."""
        if src == self.rank:
            return state.vocab["local"].pop((what, mb))
        t0 = Recorder.clock()
        state.vocab["pending"].pop((what, src, mb)).Wait()
        buf = self.buffers[(what, src, mb)]
        self._ready = Recorder.clock()  # the pass's own work starts after its last wait
        self.recorder.record(
            KIND["recv"], state.step, -1, mb, t0, self._ready, buf.nbytes, self.peer_ranks[src]
        )
        return buf

    def _send(self, state, what: int, mb: int, array: np.ndarray, dests) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        for d in dests:
            if d == self.rank:
                state.vocab["local"][(what, mb)] = array
            else:
                req = self.isend([array, MPI.FLOAT], dest=d, tag=self.tag(what, mb))
                state.send_requests.append(req)

    def _sum(self, state, what: int, mb: int) -> np.ndarray:
        """Every rank's part, added in rank order (rank 0's first)."""
        total = self._take(state, what, 0, mb).copy()
        for r in range(1, self.pp):
            total += self._take(state, what, r, mb)
        return total

    def run(self, a, state, t0: float) -> None:
        self._ready = t0
        self.run_pass[a.kind](a.microbatch, state)
        # stage -1: a share is no pipeline stage (its share is the row's rank)
        end = Recorder.clock()
        self.recorder.record(KIND[RECORD[a.kind]], state.step, -1, a.microbatch, self._ready, end)

    def _embed(self, mb: int, state) -> None:
        part = self.layer.embed(state.batches[mb][0])
        self._send(state, PART, mb, part, [self.first])

    def _logits(self, mb: int, state) -> None:
        h = self._take(state, HIDDEN, self.head, mb)
        cache, stats = self.layer.logits(h, state.batches[mb][1])
        state.vocab["local"][("cache", mb)] = cache
        self._send(state, STAT, mb, stats, range(self.pp))

    def _grad(self, mb: int, state) -> None:
        stats = [self._take(state, STAT, r, mb) for r in range(self.pp)]
        cache = state.vocab["local"].pop(("cache", mb))
        loss, hits, dh = self.layer.head_backward(cache, combine(stats), 1.0 / self.m)
        if self.rank == self.head:  # the loss counts once
            state.loss_sum += loss
            state.correct += hits
        self._send(state, DHID, mb, dh, [self.head])

    def _embed_grad(self, mb: int, state) -> None:
        dy = self._take(state, DEMB, self.first, mb)
        self.layer.embed_grad(state.batches[mb][0], dy)
        if mb == self.last_grad and self.grads_final is not None:
            self.grads_final(0)  # the share's gradient is final: its buckets may go

    # ---- what the stages' own passes exchange with the shares

    def embedding(self, mb: int, state) -> np.ndarray:
        return self._sum(state, PART, mb)

    def head_input(self, mb: int, h: np.ndarray, state) -> None:
        self._send(state, HIDDEN, mb, h, range(self.pp))

    def head_grad(self, mb: int, state) -> np.ndarray:
        return self._sum(state, DHID, mb)

    def embedding_grad(self, mb: int, dx: np.ndarray, state) -> None:
        self._send(state, DEMB, mb, dx, range(self.pp))

    # ---- evaluation (collectives over pp_comm, every rank with the same tokens)

    def eval_embed(self, tokens: np.ndarray) -> np.ndarray | None:
        part = np.ascontiguousarray(self.layer.embed(tokens), np.float32)
        total = np.empty_like(part) if self.rank == self.first else None
        self.comm.Reduce(part, total, op=MPI.SUM, root=self.first)  # one share holds each row
        return total

    def eval_logits(self, h: np.ndarray | None, rows_shape: tuple[int, ...]) -> np.ndarray | None:
        c = self.layer.dim
        if self.rank != self.head:
            h = np.empty((*rows_shape, c), np.float32)
        h = np.ascontiguousarray(h, np.float32)
        self.comm.Bcast(h, root=self.head)
        part = np.ascontiguousarray(h.reshape(-1, c) @ self.layer.weight(), np.float32)
        part += self.layer.params["bias"]
        parts = np.empty((self.pp, *part.shape), np.float32) if self.rank == self.head else None
        self.comm.Gather(part, parts, root=self.head)
        if parts is None:
            return None
        vocab = self.layer.vocab
        logits = parts.transpose(1, 0, 2).reshape(part.shape[0], -1)[:, :vocab]
        return logits.reshape(*rows_shape, vocab)
