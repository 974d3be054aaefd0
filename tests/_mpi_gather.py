"""The distributed optimizer's two rings, checked in one small launch; rank 0 prints RESULT lines.

mpiexec -n 3 python tests/_mpi_gather.py

cuts     an int8 weight gather of a vector of three tensors, a LayerNorm-like gain of ones, a
         bias of 1e-3's and a weight of 0.02's, in blocks larger than each: the error of each
         tensor relative to half a step of its own absmax scale (<= 1 with the tensor
         boundaries as cuts; without them the small tensors share the gain's scale)
buffers  (--buffers: rings of messages, as across nodes) the bytes a GPT stage's rings
         allocate (wire buffers, residual, master) against the memory model's "ring buffers",
         sharded and not, lossy or not; and what a one-half ring refuses to run
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpihybrid.comm.allreduce import RingAllreduce  # noqa: E402
from mpihybrid.comm.codecs import get_codec  # noqa: E402
from mpihybrid.comm.settings import RingSettings  # noqa: E402
from tests.helpers import abort_on_exception  # noqa: E402

sys.excepthook = abort_on_exception
comm = MPI.COMM_WORLD


def emit(**fields) -> None:
    if comm.rank == 0:
        print("RESULT", json.dumps(fields), flush=True)


def gather_errors(cuts: tuple[int, ...], transport: str) -> list[float]:
    """Each tensor's max error after an int8 gather, in units of its own absmax / 254."""
    rng = np.random.default_rng(0)
    sizes, scales = (70, 45, 200), (None, 1e-3, 0.02)
    tensors = [np.ones(sizes[0], np.float32)] + [
        (s * rng.standard_normal(n)).astype(np.float32)
        for n, s in zip(sizes[1:], scales[1:], strict=True)
    ]
    truth = np.concatenate(tensors)
    settings = RingSettings(get_codec("int8", 256), segment=128, transport=transport)
    ring = RingAllreduce(comm, truth.size, settings, role="all_gather", cuts=cuts)
    flat = np.zeros_like(truth)
    lo, hi = ring.own_range
    for request in ring.gather_steps(flat, truth[lo:hi].copy()):
        request.Wait()
    ring.close()
    same = comm.allreduce(int(np.array_equal(flat, comm.bcast(flat, root=0))), op=MPI.MIN)
    assert same, "replicas differ"
    edges = np.cumsum((0,) + sizes)
    return [
        float(np.abs(flat[a:b] - truth[a:b]).max() / (np.abs(truth[a:b]).max() / 254))
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]


def ring_buffers(sets: list[str]) -> dict:
    """A GPT stage's rings as the trainer builds them: allocated bytes against the model's."""
    from mpihybrid.comm import allreduce
    from mpihybrid.comm.device import select_backend
    from mpihybrid.config import load_job
    from mpihybrid.nn.cost import stage_work
    from mpihybrid.pipeline.schedules import build_schedule
    from mpihybrid.train import memory
    from mpihybrid.train.build import build_run

    base = ["model.kind=gpt", "data.kind=random-tokens", "model.hidden=64", "model.depth=1",
            "model.heads=2", "data.vocab=64", "data.seq_len=8", "grid.pp=1",
            f"grid.dp={comm.size}", "train.global_batch=6", "train.microbatches=1",
            "train.steps=0", "train.optimizer=adamw", "comm.block=64", "trace.path="]  # fmt: skip
    job = load_job(None, [*base, *sets], comm.size)
    # every rank as if on a node of its own (MPICH's MPIR_CVAR_NOLOCAL=1; Open MPI has none)
    allreduce.node_local = lambda _comm: False
    run = build_run(job, comm, select_backend("cpu", False, comm))
    red, opt = run.states[0].reducer, run.states[0].optimizer
    rings = red.rings + (red.param_rings or [])
    assert all(ring.shared is None for ring in rings), "rings of messages, no shared window"
    master = getattr(opt, "master", None)
    allocated = sum(ring.buffer_bytes for ring in rings)
    allocated += sum(a.nbytes for a in (red.residual, master) if a is not None)
    # a one-half ring refuses the other half (calling an allowed one would start messages)
    refused = []
    other = {"reduce_scatter": ("steps", "gather_steps"),
             "all_gather": ("steps", "reduce_scatter_steps")}  # fmt: skip
    for ring in rings:
        for call in other.get(ring.role, ()):
            try:
                next(getattr(ring, call)(np.zeros(ring.count, np.float32)), None)
            except ValueError:
                refused.append(f"{ring.role}.{call}")
    actions = build_schedule("1f1b", 1, 1)[0]
    model = memory.rank_memory(job, stage_work(job.workload), actions, ring_shared=False)["parts"]
    gathers = [ring.gather_wire.nbytes for ring in red.rings]
    red.close()
    run.gradcomm.close()
    run.grid.free()
    return {"allocated": allocated, "model": model["ring buffers"], "refused": sorted(set(refused)),
            "gradient_gather_wires": gathers}  # fmt: skip


if "--buffers" in sys.argv:
    for sets in (
        ["comm.codec=int8"],
        ["comm.codec=int8", "train.shard_optimizer=true"],
        ["comm.codec=int8", "train.shard_optimizer=true", "comm.param_codec=int8"],
        ["comm.codec=fp32", "train.shard_optimizer=true", "comm.param_codec=int8"],
        ["comm.codec=bf16", "train.shard_optimizer=true", "comm.param_codec=bf16"],
    ):
        emit(case="buffers", sets=sets, **ring_buffers(sets))  # fmt: skip
    sys.exit(0)

for transport in ("auto", "mpi"):
    emit(case="cuts", transport=transport, with_cuts=gather_errors((70, 115), transport),
         without=gather_errors((), transport))  # fmt: skip
