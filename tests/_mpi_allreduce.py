"""Ring all-reduce checks under mpiexec; rank 0 prints one JSON line per case.

    mpiexec -n 3 python tests/_mpi_allreduce.py

Each rank's input is seeded by (rank, count), so every rank can rebuild every other rank's input
and the reference sum (float64) without communication. Lines:
    CASE {...}  one all-reduce: error against the reference relative to the stated bound,
                result hashes of all ranks, bytes sent per rank
    EF {...}    running mean of T calls on a constant input, with and without error feedback
    CHECK {...} argument validation
Error bound per element i, in units of the sum (A_i = sum over ranks of |x_r[i]|, p = dp):
    each of the p encodes along the ring (p - 1 partial sums, then the owner's) errs by at most
        fp16: 2^-11 * A_i + 2^-25 (half the subnormal spacing)   bf16: 2^-8 * A_i
        int8: max_j A_j / 254 (half a step of the largest possible block scale)
    plus float32 summation: 2^-24 * A_i per addition; 1 % slack for second-order terms.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.allreduce import RingAllreduce
from mpihybrid.comm.codecs import CODECS, get_codec
from mpihybrid.comm.settings import DEFAULT_SEGMENT, RingSettings

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def make_input(r: int, count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng([seed, r, count])
    return rng.standard_normal(count).astype(np.float32)


def reference(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(sum, sum of absolute values) over every rank's input, in float64."""
    xs = [make_input(r, count, seed).astype(np.float64) for r in range(size)]
    return np.sum(xs, axis=0), np.sum(np.abs(xs), axis=0)


def error_bound(codec: str, abs_sum: np.ndarray) -> np.ndarray:
    p = size
    per_encode = {
        "fp32": 0.0 * abs_sum,
        "fp16": 2.0**-11 * abs_sum + 2.0**-25,
        "bf16": 2.0**-8 * abs_sum,
        "int8": np.full_like(abs_sum, abs_sum.max(initial=0.0) / 254),
    }[codec]
    return 1.01 * p * (per_encode + 2.0**-24 * abs_sum) + 1e-30


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def emit(kind: str, **fields) -> None:
    if rank == 0:
        print(kind, json.dumps(fields), flush=True)


def run_case(count: int, codec_name: str, op: str, segment: int = DEFAULT_SEGMENT) -> None:
    x = make_input(rank, count)
    ring = RingAllreduce(comm, count, RingSettings(get_codec(codec_name), segment=segment))
    flat = x.copy()
    sent = ring(flat, op=op)
    # one message per chunk: elementwise codecs give the same bits whatever the segments
    whole = x.copy()
    RingAllreduce(comm, count, RingSettings(get_codec(codec_name), segment=max(count, 1)))(
        whole, op=op
    )
    # the same ring with every segment sent as a message, not read from shared memory
    messages = x.copy()
    by_mpi = RingAllreduce(
        comm, count, RingSettings(get_codec(codec_name), segment=segment, transport="mpi")
    )
    by_mpi(messages, op=op)
    ring.close()
    same_as_messages = bool(comm.allreduce(np.array_equal(flat, messages), op=MPI.LAND))
    ref_sum, abs_sum = reference(count)
    divisor = size if op == "mean" else 1
    err = np.abs(flat.astype(np.float64) - ref_sum / divisor)
    bound = error_bound(codec_name, abs_sum) / divisor
    err_ratio = float(np.max(err / bound, initial=0.0))
    gathered = comm.gather(
        (digest(flat), sent, dict(ring.bytes_sent), bool(np.array_equal(flat, x))), root=0
    )
    if rank == 0:
        hashes, sent_all, by_kind, unchanged = zip(*gathered, strict=True)
        emit(
            "CASE",
            dp=size,
            count=count,
            codec=codec_name,
            op=op,
            segment=segment,
            same_as_whole=bool(np.array_equal(flat, whole)),
            same_as_messages=same_as_messages,
            shared=ring.shared is not None,
            messages_shared=by_mpi.shared is not None,
            err_ratio=err_ratio,
            max_err=float(err.max(initial=0.0)),
            identical=len(set(hashes)) == 1,
            sent=list(sent_all),
            reduce_scatter=[b["reduce_scatter"] for b in by_kind],
            all_gather=[b["all_gather"] for b in by_kind],
            unchanged=all(unchanged),
        )


def run_error_feedback(count: int, codec_name: str, steps: int) -> None:
    """Same constant input every call: feedback makes the running mean converge to the truth."""
    x = make_input(rank, count, seed=1)
    ref_sum, _ = reference(count, seed=1)
    result = {}
    for feedback in (True, False):
        ring = RingAllreduce(
            comm, count, RingSettings(get_codec(codec_name), error_feedback=feedback)
        )
        total = np.zeros(count)
        flat = np.empty_like(x)
        sent = 0
        for _ in range(steps):
            flat[:] = x
            sent += ring(flat, op="mean")
            total += flat
        err = float(np.max(np.abs(total / steps - ref_sum / size)))
        result["ef" if feedback else "plain"] = err
        result["bytes_ok_" + ("ef" if feedback else "plain")] = sent == sum(
            ring.bytes_sent.values()
        )
    emit("EF", dp=size, count=count, codec=codec_name, steps=steps, **result)


def run_checks() -> None:
    ring = RingAllreduce(comm, 10, RingSettings(get_codec("fp32")))
    rejected = []
    for bad in (np.zeros(10, np.float64), np.zeros(11, np.float32), np.zeros(20, np.float32)[::2]):
        try:
            ring(bad)
            rejected.append(False)
        except ValueError:
            rejected.append(True)
    try:
        ring(np.zeros(10, np.float32), op="max")
        rejected.append(False)
    except ValueError:
        rejected.append(True)
    emit("CHECK", dp=size, rejected=rejected)


def main() -> None:
    counts = sorted({0, 1, size - 1, 1000, 1001, 2**20})
    for count in counts:
        for codec_name in CODECS:
            run_case(count, codec_name, "mean")
    for codec_name in CODECS:
        run_case(1001, codec_name, "sum")
        # many segments per chunk, the last one short: the pipelined path
        for count in (1000, 4099):
            run_case(count, codec_name, "mean", segment=333)
    if size > 1:
        for codec_name in ("fp16", "bf16", "int8"):
            run_error_feedback(
                1001, codec_name, steps=int(sys.argv[1]) if len(sys.argv) > 1 else 64
            )
    run_checks()


if __name__ == "__main__":
    main()
