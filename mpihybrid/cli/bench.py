"""All-reduce benchmark: the hand-written ring (each codec) against MPI's own Allreduce.

    mpiexec -n 4 python -m mpihybrid.cli.bench
    mpiexec -n 4 python -m mpihybrid.cli.bench --sizes 1M,16M --codecs fp32,int8 --repeats 10

Both sum the same float32 buffer in the same process. Definitions follow nccl-tests:
    time   median over repeats of the slowest rank's time for one call
    algbw  size / time
    busbw  algbw * 2 (n - 1) / n: the bandwidth each link would need for a ring to take `time`
    wire   bytes one rank puts on the wire per call (largest over ranks; unknown for MPI's own)
    ratio  ring time / MPI time at the same size

bench_codecs (`mpihybrid bench codecs`): GB/s per core of every codec operation, the numba
kernels beside the numpy references, on one process.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from mpihybrid.comm.allreduce import RingAllreduce
from mpihybrid.comm.codecs import CODECS, get_codec
from mpihybrid.comm.settings import DEFAULT_SEGMENT, RingSettings
from mpihybrid.units import human_bytes
from mpihybrid.units import table as text_table

DEFAULT_SIZES = [4096 * 4**i for i in range(8)]  # 4 KiB .. 64 MiB


def _time_call(comm: MPI.Comm, call: Callable[[], None], reset: Callable[[], None]) -> float:
    """One synchronised call; the slowest rank's time, known to every rank."""
    reset()
    comm.Barrier()
    start = time.perf_counter()
    call()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)


def _median_times(
    comm: MPI.Comm,
    calls: list[Callable[[], None]],
    reset: Callable[[], None],
    repeats: int,
    warmup: int,
) -> list[float]:
    """Median time of each call, the calls taking turns within every repeat: a ratio between
    two of them then compares calls made under the same conditions (drift in the machine's
    load or clock falls on both alike)."""
    for _ in range(warmup):
        for call in calls:
            _time_call(comm, call, reset)
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, seen in zip(calls, times, strict=True):
            seen.append(_time_call(comm, call, reset))
    return [statistics.median(seen) for seen in times]


def _row(size: int, codec: str, impl: str, seconds: float, n: int, *, wire: int | None) -> dict:
    algbw = size / seconds if seconds > 0 else 0.0
    return {
        "size": size,
        "codec": codec,
        "impl": impl,
        "time": seconds,
        "algbw": algbw,
        "busbw": algbw * 2 * (n - 1) / n,
        "wire_bytes": wire,
        "ratio": 1.0,
    }


def bench_allreduce(
    comm: MPI.Comm,
    sizes_bytes: list[int],
    codecs: list[str],
    repeats: int = 5,
    warmup: int = 2,
    *,
    segment: int = DEFAULT_SEGMENT,
    progress=None,
    transport: str = "auto",
) -> list[dict]:
    """One row per (size, implementation): MPI's Allreduce, then the ring for each codec, timed
    in turns (progress: a line per size).

    Both compute a sum (op="sum"), the ring with error feedback as training uses it, cutting its
    chunks into messages of `segment` elements, over `transport` (RingAllreduce). Every rank
    returns the same rows.
    """
    for name in codecs:
        get_codec(name)  # reject unknown names before any timing
    n = comm.Get_size()
    rng = np.random.default_rng([7, comm.Get_rank()])
    rows = []
    for size in sizes_bytes:
        count = size // 4
        src = rng.standard_normal(count, dtype=np.float32)
        flat = np.empty_like(src)

        def reset(flat=flat, src=src) -> None:
            np.copyto(flat, src)  # a sum grows: restart from the same input every call

        def native(flat=flat) -> None:
            comm.Allreduce(MPI.IN_PLACE, [flat, MPI.FLOAT], op=MPI.SUM)

        rings = [
            RingAllreduce(
                comm, count, RingSettings(get_codec(name), segment=segment, transport=transport)
            )
            for name in codecs
        ]
        sent: list[list[int]] = [[] for _ in codecs]

        def ring_call(ring: RingAllreduce, sent: list[int], flat=flat) -> Callable[[], None]:
            return lambda: sent.append(ring(flat, op="sum"))

        calls = [native] + [ring_call(ring, seen) for ring, seen in zip(rings, sent, strict=True)]
        native_time, *ring_times = _median_times(comm, calls, reset, repeats, warmup)
        for ring in rings:
            ring.close()
        rows.append(_row(count * 4, "fp32", "mpi", native_time, n, wire=None))
        for name, ring_time, seen in zip(codecs, ring_times, sent, strict=True):
            row = _row(
                count * 4, name, "ring", ring_time, n, wire=comm.allreduce(max(seen), op=MPI.MAX)
            )
            row["ratio"] = ring_time / native_time if native_time > 0 else float("nan")
            rows.append(row)
        if progress is not None:
            done = sizes_bytes.index(size) + 1
            what = f"{human_bytes(size)}: MPI_Allreduce {_human_time(native_time)}"
            progress(f"[{done}/{len(sizes_bytes)}] {what}")
    return rows


def _human_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table (bandwidths in GB/s = 1e9 bytes per second)."""
    header = ("size", "impl", "codec", "time", "algbw GB/s", "busbw GB/s", "wire/rank", "ring/mpi")
    table = [header]
    for r in rows:
        table.append(
            (
                human_bytes(r["size"], 1),
                r["impl"],
                r["codec"],
                _human_time(r["time"]),
                f"{r['algbw'] / 1e9:.3f}",
                f"{r['busbw'] / 1e9:.3f}",
                "-" if r["wire_bytes"] is None else human_bytes(r["wire_bytes"], 1),
                f"{r['ratio']:.2f}",
            )
        )
    return "\n".join(text_table(list(table[0]), [list(r) for r in table[1:]], labels=0))


# encode+feedback: x + residual encoded, the new error kept (the ring's first hop);
# reduce-encode: decode-add, encode and decode of the sum in one pass (the ring owner's last hop)
CODEC_OPERATIONS = (
    "encode",
    "encode+residual",
    "encode+feedback",
    "decode",
    "decode-add",
    "reduce-encode",
)


def bench_codecs(size: int, codecs: list[str], repeats: int = 5, block: int = 256) -> list[dict]:
    """GB/s of every codec operation on `size` bytes of float32, fast path and numpy reference.

    GB/s = float32 input bytes / CPU time of this thread (a codec runs on one core; CPU time
    leaves out the time other processes take the core, so a shared machine still measures the
    kernel), median of `repeats`. The two implementations alternate call by call, so drift
    affects both alike. One row per (codec, operation): fast, numpy, and fast / numpy.
    """
    count = size // 4
    x = np.random.default_rng(7).standard_normal(count, dtype=np.float32)
    residual, decoded = np.empty_like(x), np.empty_like(x)
    acc = np.zeros_like(x)
    rows = []
    for name in codecs:
        impls = {k: get_codec(name, block, kernels=k) for k in ("auto", "numpy")}
        wire = np.empty(impls["auto"].nbytes(count), np.uint8)
        impls["auto"].encode(x, wire)
        out = np.empty_like(wire)
        calls = {
            "encode": lambda c, wire=wire: c.encode(x, wire),
            "encode+residual": lambda c, wire=wire: c.encode(x, wire, residual),
            "decode": lambda c, wire=wire: c.decode(wire, count, decoded),
            "decode-add": lambda c, wire=wire: c.decode_add(wire, count, acc),
            "encode+feedback": lambda c, wire=wire: c.encode(x, wire, residual, True),
            "reduce-encode": lambda c, wire=wire, o=out: c.reduce_encode(wire, acc, o, residual),
        }
        for op in CODEC_OPERATIONS:
            times: dict[str, list[float]] = {k: [] for k in impls}
            for i in range(repeats + 1):  # the first round compiles / warms up, untimed
                for kernels, codec in impls.items():
                    start = time.thread_time()
                    calls[op](codec)
                    if i:
                        times[kernels].append(time.thread_time() - start)
            rate = {k: 4 * count / max(statistics.median(t), 1e-9) / 1e9 for k, t in times.items()}
            rows.append(
                {"codec": name, "operation": op, "fast": rate["auto"], "numpy": rate["numpy"]}
            )
    return rows


def format_codec_table(rows: list[dict]) -> str:
    """The rows of bench_codecs as an aligned text table."""
    table = [("codec", "operation", "fast GB/s", "numpy GB/s", "fast/numpy")]
    for r in rows:
        ratio = r["fast"] / r["numpy"] if r["numpy"] > 0 else float("nan")
        table.append(
            (r["codec"], r["operation"], f"{r['fast']:.2f}", f"{r['numpy']:.2f}", f"{ratio:.1f}")
        )
    return "\n".join(text_table(list(table[0]), [list(r) for r in table[1:]], labels=2))


def memory_needed(kind: str, size: int, codecs: int, ranks_on_node: int = 1) -> int:
    """Bytes a node needs for `bench codecs` or `bench allreduce` at `size` bytes of float32:
    codecs holds the input, residual, decoded and sum vectors, two wires and the references'
    temporaries (~8 sizes); allreduce per rank the input, its copy, MPI's result and every
    codec's ring (residual and wire: ~2 sizes each), for every rank of the node."""
    if kind == "codecs":
        return 8 * size
    return (3 + 2 * codecs) * size * ranks_on_node


def check_memory(what: str, needed: int, available: int | None) -> None:
    """ValueError (one line) when the node's MemAvailable cannot hold `needed` bytes."""
    if available is not None and needed > available:
        raise ValueError(
            f"{what} needs about {human_bytes(needed, 1)} of memory, the node has "
            f"{human_bytes(available, 1)} available: choose a smaller size"
        )


def parse_size(text: str) -> int:
    """'4096', '4K', '16M', '1G' (binary units) -> bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"bad size {text!r}: use bytes or a K/M/G suffix, e.g. 64K") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mpihybrid.cli.bench", description="ring all-reduce vs MPI Allreduce"
    )
    parser.add_argument("--sizes", default=None, help="comma list, e.g. 4K,1M,64M")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma list of codecs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    comm = MPI.COMM_WORLD
    rows = bench_allreduce(comm, sizes, args.codecs.split(","), args.repeats, args.warmup)
    if comm.Get_rank() == 0:
        print(f"all-reduce over {comm.Get_size()} ranks, median of {args.repeats}")
        print(format_table(rows))


if __name__ == "__main__":
    main()
