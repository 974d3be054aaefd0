"""What a run records as it goes (Record) and what rank 0 reports at the end (Summary), with the
collectives that end a run: the replica check, the bytes sent, replica 0's parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.device import host_array
from mpihybrid.pipeline.as_run import grid_as_run
from mpihybrid.train.evaluate import HeldOutLoss
from mpihybrid.train.history import History
from mpihybrid.train.live_stragglers import LiveStragglers
from mpihybrid.train.probe import CoreProbe


@dataclass
class Record:
    """What a run records on a rank as its steps go (the run itself is train.build.Run)."""

    start: int = 0  # first step to run (after a resume, the checkpoint's)
    losses: History = field(default_factory=History)  # by step, in a fixed ring
    accuracies: History = field(default_factory=History)
    peak_inflight: dict = field(default_factory=dict)  # stage -> most activations alive at once
    peak_rss: int = 0  # this rank's peak resident set at the end of the training steps
    # the step line counts from (step, rank 0's clock, held-out seconds) of the line before
    log_from: tuple[int, float, float] = (0, 0.0, 0.0)
    usr1_warned: bool = False  # said once: SIGUSR1 came but there is no checkpoint.dir
    calibrating: bool = False  # train.schedule = "auto"'s steps before the job's (train())
    held_out: HeldOutLoss = field(default_factory=HeldOutLoss)  # losses every eval_every steps
    grad_norm: float = math.nan  # the last step's global gradient norm (train.grad_clip)
    grad_norms: list = field(default_factory=list)  # every step's of this run (train.grad_clip)
    stragglers: LiveStragglers = field(default_factory=LiveStragglers)  # the live line
    probe: CoreProbe | None = None  # this core's speed (a traced run on the CPU: train.loop)


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
    # every rank's trace events since the trace's last flush (when the run writes no trace file:
    # those of its last UNTRACED_STEPS steps or more), rank 0's clock, run start = 0
    events: np.ndarray | None = None
    extra: dict = field(default_factory=dict)
    start: int = 0  # the step this run began at (a resumed run ran steps - start of them)
    # every rank's peak resident set over the training steps (before evaluation), rank order
    peak_rss_bytes: list[int] | None = None
    # held-out loss every train.eval_every steps: {"step" (from 1), "loss" (nats per token),
    # "bits_per_token", "bits_per_byte" (nan unless a token is a byte), "perplexity"}
    evals: list[dict] = field(default_factory=list)


def last_grid(events: np.ndarray, placement, step: int) -> str:
    # a trace window that leaves out the last step leaves nothing to draw
    return grid_as_run(events, placement, step) if np.any(events["step"] == step) else ""


REPLICA_BLOCK = 1 << 18  # floats compared at once by the replica check (1 MiB)


def replica_check(world, grid, stages) -> dict[int, float]:
    """max |w - w_replica0| for every stage (0.0 means the replicas are bit-identical), in
    blocks of REPLICA_BLOCK: the whole-stage copy, difference and absolute value it once made
    were three parameter-sized temporaries at the end of a run, the run's memory peak
    (+220 MiB a rank at hidden 3072)."""
    local = {}
    for s, st in stages.items():
        mine, diff = host_array(st.flat_params), 0.0
        block = np.empty(min(REPLICA_BLOCK, mine.size), np.float32)
        for lo in range(0, mine.size if grid.dp_size > 1 else 0, REPLICA_BLOCK):
            piece = block[: min(REPLICA_BLOCK, mine.size - lo)]
            piece[...] = mine[lo : lo + len(piece)]
            grid.dp_comm.Bcast([piece, MPI.FLOAT], root=0)
            np.subtract(mine[lo : lo + len(piece)], piece, out=piece)
            worst = float(np.abs(piece, out=piece).max())
            diff = worst if worst != worst else max(diff, worst)  # a nan stays
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


def bytes_sent(world, runtime, states) -> dict[str, int]:
    """Every rank's bytes by kind (pipeline messages, ring halves), summed on rank 0."""
    mine = dict(runtime.bytes_sent)
    for st in states.values():
        for kind, n in st.reducer.bytes_sent.items():
            mine[kind] = mine.get(kind, 0) + n
    gathered = world.gather(mine, root=0)
    if gathered is None:
        return {}
    total: dict[str, int] = {}
    for part in gathered:
        for kind, n in part.items():
            total[kind] = total.get(kind, 0) + int(n)
    return total
