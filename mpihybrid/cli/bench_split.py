"""bench train's time split: where each rank's wall goes over the measured steps (GEMMs,
elementwise, optimizer, communication; the main thread in pieces by op that add up to 100 %),
from the run's events and every chunk's profile by op (nn/profile.py).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpihybrid.config import Job
from mpihybrid.trace.recorder import KIND
from mpihybrid.units import table as text_table


def measured_wall(events: np.ndarray, first: int) -> float:
    """Rank 0's wall time from the start of step `first` to the end of the last step (the
    per-step metrics collective included)."""
    rows = events[(events["kind"] == KIND["step"]) & (events["rank"] == 0)]
    rows = rows[rows["step"] >= first]
    return float(rows["end"].max() - rows["start"].min())


def busy(events: np.ndarray, first: int, wall: float) -> tuple[dict, dict]:
    """Compute time (forward, backward, weight, optimizer) of the measured steps / wall time,
    per rank and per stage (a stage's replicas summed)."""
    kinds = [KIND[k] for k in ("forward", "backward", "weight", "optimizer")]
    rows = events[np.isin(events["kind"], kinds) & (events["step"] >= first)]
    took = rows["end"] - rows["start"]
    per_rank = {
        int(r): float(took[rows["rank"] == r].sum()) / wall for r in np.unique(rows["rank"])
    }
    per_stage = {
        int(s): float(took[rows["stage"] == s].sum()) / wall for s in np.unique(rows["stage"])
    }
    return per_rank, per_stage


# what the main thread spends on communication: point-to-point waits and the wait for the
# gradient buckets after the pipeline; the buckets' rings themselves may run behind the compute
_COMM_KINDS = ("send", "recv", "grad_wait")


def time_split(
    events: np.ndarray,
    *,
    first: int,
    wall: float,
    ranks: list[dict],
    gemm: dict[int, float],
    profiles: dict[int, dict[str, float]],
) -> list[dict]:
    """Per rank, fractions of the measured wall time: GEMM (`gemm[rank]`: seconds of matmuls at
    the rank's measured rate), elementwise (the rest of F/B/W), optimizer, communication (the
    main thread's waits: p2p and gradients); exposed = the gradient wait alone, hidden = the
    share of the buckets' all-reduce + optimizer time that ran behind the compute. `parts`: the
    main thread's wall time in pieces that add up to 1 (see _parts)."""
    rows = events[events["step"] >= first]
    took = rows["end"] - rows["start"]

    def seconds(rank: int, kinds) -> float:
        codes = [KIND[k] for k in kinds if k in KIND]
        return float(took[(rows["rank"] == rank) & np.isin(rows["kind"], codes)].sum())

    split = []
    for r in ranks:
        rank = r["rank"]
        compute = seconds(rank, ("forward", "backward", "weight"))
        matmul = min(gemm.get(rank, 0.0), compute)
        wait = seconds(rank, ("grad_wait",))
        bucket_work = seconds(rank, ("allreduce", "optimizer"))
        split.append(
            {
                "rank": rank,
                "parts": _parts(
                    rank, compute, _rank_wall(events, first, rank), seconds, profiles.get(rank, {})
                ),
                "gemm": matmul / wall,
                "elementwise": (compute - matmul) / wall,
                "optimizer": seconds(rank, ("optimizer",)) / wall,
                "communication": seconds(rank, _COMM_KINDS) / wall,
                "exposed_allreduce": wait / wall,
                "allreduce_hidden": max(0.0, 1 - wait / bucket_work) if bucket_work else 0.0,
            }
        )
    return split


def _rank_wall(events: np.ndarray, first: int, rank: int) -> float:
    """The rank's own wall time over the measured steps (its clock, its step rows)."""
    rows = events[(events["kind"] == KIND["step"]) & (events["rank"] == rank)]
    rows = rows[rows["step"] >= first]
    return float(rows["end"].max() - rows["start"].min())


# the order the time split prints its pieces in
_PARTS = ("GEMM (Linear)", "attention", "GELU", "LayerNorm", "embedding", "loss", "glue")


def _parts(rank: int, compute: float, wall: float, seconds, profile: dict) -> dict[str, float]:
    """The rank's main thread over the measured steps, fractions of wall adding up to 1: its
    F/B/W time cut by op as the rank's chunks' profile (profile_chunk: Linear GEMMs, attention,
    GELU, LayerNorm, embedding, loss, glue) cuts it; sends; receives (waiting for a neighbour:
    the bubble, and the copies); the wait for the gradient buckets (exposed all-reduce and the
    optimizer updates left to it); runtime: the rest (Python between actions, step metrics)."""
    total = sum(profile.values())
    keys = [k for k in _PARTS if k in profile] + [k for k in profile if k not in _PARTS]
    parts = {k: compute * profile[k] / total / wall for k in keys} if total else {}
    if not total:
        parts["compute"] = compute / wall
    parts["send"] = seconds(rank, ("send",)) / wall
    parts["recv (bubble)"] = seconds(rank, ("recv",)) / wall
    parts["gradient wait"] = seconds(rank, ("grad_wait",)) / wall
    parts["runtime"] = max(0.0, 1.0 - sum(parts.values()))
    return parts


def profile_chunks(job: Job, world: MPI.Comm) -> dict[int, dict[str, float]] | None:
    """Every rank at once profiles some model chunks (chunk c on the ranks r with c = r modulo
    min(world, chunks)); rank 0 gets {chunk: seconds per micro-batch by op}."""
    from mpihybrid.nn.profile import profile_chunk

    n = job.workload.chunks
    mod = min(world.size, n)
    mine = {
        c: profile_chunk(job.workload, c, repeats=2)
        for c in range(n)
        if c % mod == world.rank % mod
    }
    gathered = world.gather(mine, root=0)
    if world.rank != 0:
        return None
    out: dict[int, dict[str, float]] = {}
    for part in gathered:
        for c, prof in part.items():
            out.setdefault(c, prof)
    return out


def rank_profiles(ranks: list[dict], chunks: dict[int, dict[str, float]]) -> dict:
    """Each rank's profile: the sum over its chunks, op by op."""
    out = {}
    for r in ranks:
        prof: dict[str, float] = {}
        for s in r["stages"]:
            for k, v in chunks.get(s, {}).items():
                prof[k] = prof.get(k, 0.0) + v
        out[r["rank"]] = prof
    return out


def _order(key: str) -> int:
    return _PARTS.index(key) if key in _PARTS else 0


def format_parts(split: list[dict]) -> list[str]:
    """The time split as a table: one row per piece, one column per rank, columns add to 100."""
    keys = list(dict.fromkeys(k for t in split for k in t["parts"]))
    tail = ("send", "recv (bubble)", "gradient wait", "runtime")
    ops = sorted((k for k in keys if k not in tail), key=lambda k: (k not in _PARTS, _order(k)))
    keys = ops + [k for k in tail if k in keys]
    header = ["time split (% of each rank's wall; adds up to 100)"]
    header += [f"rank {t['rank']}" for t in split]
    rows = [[k, *(f"{100 * t['parts'].get(k, 0.0):.1f}" for t in split)] for k in keys]
    return text_table(header, rows)
