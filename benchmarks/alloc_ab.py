"""Does allocation cost a step? Page faults per step; GEMMs into fresh vs reused outputs.

    mpiexec -n 2 python benchmarks/alloc_ab.py faults jobs/gpt_bench.toml --set grid.pp=1 \
        --set grid.dp=2                            # every rank: faults, CPU and wall per step
    python benchmarks/alloc_ab.py gemms jobs/gpt_bench.toml --rows 64    # one process

faults: runs `train()` on the job and reads getrusage around every step: minor and major page
faults, user and system CPU, wall, context switches; prints each rank's medians over the steps
after the first four (the first step faults its buffers in).
gemms: the model's Linear GEMMs of one micro-batch (forward x @ W, input gradient dy @ W^T,
weight gradient x^T @ dy added to the gradient), each layer with weights of its own as in a
step, once with numpy's fresh outputs and once into preallocated `out=` buffers, interleaved
round by round; and the roofline's form of the same forward shapes (bench train), for scale.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

# mpihybrid before numpy: it sets the OpenBLAS kernels `bench blas` chose (mpihybrid/_blas.py)
from mpihybrid.comm.device import keep_freed_host_memory


def faults(job_path: str, overrides: list[str], steps: int) -> None:
    from mpi4py import MPI

    import mpihybrid.train.loop as loop
    from mpihybrid.config import load_job

    world = MPI.COMM_WORLD
    job = load_job(job_path, [*overrides, f"train.steps={steps}", "train.log_every=0"], world.size)
    rows = []
    step_once = loop._train_step

    def measured(*args, **kwargs) -> None:
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step_once(*args, **kwargs)
        wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        rows.append(
            {
                "minor faults": after.ru_minflt - before.ru_minflt,
                "major faults": after.ru_majflt - before.ru_majflt,
                "user ms": 1e3 * (after.ru_utime - before.ru_utime),
                "system ms": 1e3 * (after.ru_stime - before.ru_stime),
                "wall ms": 1e3 * wall,
                "involuntary switches": after.ru_nivcsw - before.ru_nivcsw,
            }
        )

    loop._train_step = measured
    loop.train(job, world, quiet=True)
    steady = rows[4:]
    medians = ", ".join(f"{k} {statistics.median(r[k] for r in steady):.1f}" for k in rows[0])
    first = [r["minor faults"] for r in rows[:4]]
    print(f"rank {world.rank}: steps 5-{len(rows)}, median: {medians}; minor faults of steps 1-4: "
          f"{first}", flush=True)  # fmt: skip


def gemms(job_path: str, overrides: list[str], rows: int, rounds: int) -> None:
    import numpy as np

    from mpihybrid.config import load_job
    from mpihybrid.nn.layers import Linear
    from mpihybrid.nn.model import build_blocks

    job = load_job(job_path, ["grid.pp=1", "grid.dp=1", *overrides], 1)  # the whole model

    def leaves(layers):  # a residual branch's layers sit inside it
        for layer in layers:
            yield from leaves(layer.branch) if hasattr(layer, "branch") else [layer]

    blocks = build_blocks(job.model, job.data.seq_len, job.data.vocab)
    linears = [layer for block in blocks for layer in leaves(block) if isinstance(layer, Linear)]
    rng = np.random.default_rng(0)
    ops = []
    for lin in linears:
        i, o = lin.in_features, lin.out_features
        ops.append(
            {
                "W": rng.standard_normal((i, o), np.float32),
                "G": np.zeros((i, o), np.float32),
                "x": rng.standard_normal((rows, i), np.float32),
                "dy": rng.standard_normal((rows, o), np.float32),
                "y": np.empty((rows, o), np.float32),
                "dx": np.empty((rows, i), np.float32),
                "t": np.empty((i, o), np.float32),
            }
        )

    def fresh() -> None:
        for op in ops:
            op["x"] @ op["W"]
        for op in reversed(ops):
            op["dy"] @ op["W"].T
            op["G"] += op["x"].T @ op["dy"]

    def reused() -> None:
        for op in ops:
            np.matmul(op["x"], op["W"], out=op["y"])
        for op in reversed(ops):
            np.matmul(op["dy"], op["W"].T, out=op["dx"])
            np.matmul(op["x"].T, op["dy"], out=op["t"])
            op["G"] += op["t"]

    roof = [(op["x"][None], op["W"][None], op["y"][None]) for op in ops]

    def roofline_form() -> None:  # bench train's measure_gemm_rate: forward shapes, out=
        for a, b, out in roof:
            np.matmul(a, b, out=out)

    times: dict[str, list[float]] = {"fresh": [], "out=": [], "roofline form (F only)": []}
    for _ in range(rounds + 2):
        for name, f in zip(times, (fresh, reused, roofline_form), strict=True):
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    flops = sum(2 * rows * op["W"].size for op in ops)
    print(f"{len(ops)} Linear layers, {rows} rows, median of {rounds} interleaved rounds:")
    base = statistics.median(times["fresh"][2:])
    for name, ts in times.items():
        m = statistics.median(ts[2:])
        passes = 1 if name.startswith("roofline") else 3
        print(f"  {name:24s} {1e3 * m:7.2f} ms  {passes * flops / m / 1e9:6.1f} GFLOP/s"
              f"  {m / base:.3f} of fresh")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["faults", "gemms"])
    parser.add_argument("job")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=16, help="faults: training steps")
    parser.add_argument("--rows", type=int, default=64, help="gemms: tokens per micro-batch")
    parser.add_argument("--rounds", type=int, default=20, help="gemms: timed rounds")
    args = parser.parse_args()
    keep_freed_host_memory()  # as train() does
    if args.mode == "faults":
        faults(args.job, args.overrides, args.steps)
    else:
        gemms(args.job, args.overrides, args.rows, args.rounds)


if __name__ == "__main__":
    main()
