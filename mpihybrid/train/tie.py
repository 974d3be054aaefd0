"""model.tie_embeddings: nanoGPT's wte = lm_head, across the pipeline (Megatron's embedding group).

    group = embedding_group(pp_comm, states, placement, backend, cfg)  # None: holds neither
    group.refresh()      # collective (the two ranks): the head's rank sees the table
    group.sum_grads()    # collective, after the backwards: the head's gradient joins the table's
    bind_local(stages, cfg)  # one process holding both (generate, export, the serial reference)

The model kind says where the pair sits (nn/kinds.py: Tie): the token table (V, C) is a
parameter of the first stage (its Embedding); the tied head (nn.layers.Linear(tied=True)), the
last layer of the last stage, has no weight in its stage's flat buffer. A checkpoint, the
optimizer (sharded or not), the gradient ring and the global norm therefore hold the table once,
and a checkpoint of a tied model resumes on any grid and under any schedule.
- One rank holds both (pp = 1, a V placement): the head's weight and its gradient are the table's
  and the table gradient's transposed views: one parameter, both layers' gradients accumulate
  into it.
- Two ranks (the embedding group): the head's rank keeps a mirror of the table and a gradient of
  its shape (the head's weight = mirror.T). Every step, after the backwards, it sends that
  gradient to the first stage's rank, which adds it to the table's before the table's bucket goes
  to its ring (Reducer.gated); after the update, the first stage's rank sends the table back into
  the mirror (before the next step and any evaluation). V x C floats each way a step, as
  Megatron's all-reduce of its two copies' gradients, but the optimizer state is held once.
Either way the bucket holding the table waits for the step's last backward (the gate), so a
zero-bubble W of the head late in the step still lands in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.device import copy_from_host, host_array
from mpihybrid.nn.kinds import model_kind

TAG = 7_900  # the head's gradient on pp_comm; TAG + 1: the table back


def _pair(stages, cfg) -> tuple[object, object, str]:
    """(the table's layer, the tied head, the table's parameter name) among `stages`, where
    the model kind says they sit (nn/kinds.py: ModelKind.tied_pair); None for one not there."""
    kind = model_kind(cfg.kind)
    table, head = kind.tied_pair(cfg, stages)
    return table, head, kind.tie.param if kind.tie is not None else ""


def bind_local(stages, cfg) -> bool:
    """Where these stages (a dict or a list) hold both the embedding and the tied head of the
    model `cfg`: the head's weight and gradient become the table's transposed views. Returns
    whether it did (False: an untied model, or one of the pair is elsewhere)."""
    stages = list(stages.values() if isinstance(stages, dict) else stages)
    table, head, param = _pair(stages, cfg)
    if table is None or head is None:
        return False
    head.tie(table.params[param].T, table.grads[param].T)
    return True


@dataclass
class EmbeddingGroup:
    """This rank's part in the tie: the embedding, the head, or both (peer = -1)."""

    comm: MPI.Comm  # pp_comm
    peer: int  # the other rank of the pair in pp_comm; -1: this rank holds both
    embedding: object | None  # the first stage's Embedding layer, on its rank
    head: object | None  # the tied head (nn.layers.Linear), on its rank
    gate: object | None  # the first stage's Reducer: its table bucket waits for sum_grads()
    backend: object
    param: str  # the table's name among the embedding's parameters (the kind's Tie.param)
    mirror: object = None  # the head's rank: the table (V, C), and its gradient
    mirror_grad: object = None

    def sum_grads(self) -> None:
        """After the step's backwards: the table's gradient gets the head's; the table's bucket
        goes to its ring. The head's rank sends and zeroes its gradient for the next step."""
        if self.peer >= 0 and self.embedding is not None:
            grad = self.embedding.grads[self.param]
            theirs = np.empty(grad.shape, np.float32)
            self.comm.Recv(theirs, self.peer, TAG)
            grad += self.backend.asarray(theirs)
        elif self.peer >= 0:
            self.comm.Send(np.ascontiguousarray(host_array(self.mirror_grad)), self.peer, TAG)
            self.mirror_grad.fill(0)
        if self.gate is not None:
            self.gate.open_gate()

    def refresh(self) -> None:
        """After the table changed (the start, a resume, every update): the head's mirror is the
        table again. A no-op where one rank holds both."""
        if self.peer < 0:
            return
        if self.embedding is not None:
            table = np.ascontiguousarray(host_array(self.embedding.params[self.param]))
            self.comm.Send(table, self.peer, TAG + 1)
            return
        if isinstance(self.mirror, np.ndarray):
            self.comm.Recv(self.mirror, self.peer, TAG + 1)
        else:
            host = np.empty(self.mirror.shape, np.float32)
            self.comm.Recv(host, self.peer, TAG + 1)
            copy_from_host(self.mirror, host)


def embedding_group(
    pp_comm: MPI.Comm, states: dict, placement, backend, cfg
) -> EmbeddingGroup | None:
    """This rank's part in the tied model `cfg` (states: stage index -> train.state.StageState),
    after the stages are where they compute (to_device): the head bound to the table (one rank)
    or to a mirror (two ranks), the table's bucket gated. None: neither is on this rank."""
    first, last = 0, placement.num_stages - 1
    stages = {s: st.stage for s, st in states.items()}
    if first not in stages and last not in stages:
        return None
    gate = states[first].reducer if first in stages else None
    if gate is not None:
        gate.gated = True
    table, head, param = _pair(stages.values(), cfg)
    if bind_local(stages, cfg):
        return EmbeddingGroup(pp_comm, -1, table, head, gate, backend, param)
    if table is not None:
        peer = placement.rank_of(last)
        return EmbeddingGroup(pp_comm, peer, table, None, gate, backend, param)
    width, vocab = head.in_features, head.out_features
    mirror = backend.zeros((vocab, width), np.float32)
    mirror_grad = backend.zeros((vocab, width), np.float32)
    head.tie(mirror.T, mirror_grad.T)
    return EmbeddingGroup(
        pp_comm, placement.rank_of(first), None, head, None, backend, param, mirror, mirror_grad
    )


def held_nbytes(first_on_rank: bool, last_on_rank: bool, vocab: int, width: int) -> int:
    """Bytes a rank holds for the tie beyond its stages' flat buffers (the memory model): the
    head's rank apart from the embedding's, the mirror and its gradient; the embedding's rank,
    the head's gradient as it arrives. One rank holding both: nothing."""
    if first_on_rank == last_on_rank:
        return 0
    return (2 if last_on_rank else 1) * 4 * vocab * width
