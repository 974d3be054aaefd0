"""Where one stage's time goes, layer by layer: forward, input and weight gradient.

    python benchmarks/stage_profile.py jobs/gpt_bench.toml            # chunk 0 of pp
    python benchmarks/stage_profile.py jobs/gpt_bench.toml --chunk 1
    python benchmarks/stage_profile.py jobs/gpt_bench.toml --default-malloc  # without mallopt
    python benchmarks/stage_profile.py jobs/gpt_bench.toml --partition  # split by measured cost

Runs M micro-batches of forward, then backward_input + backward_weight, as a pipeline stage
does (activations of all M alive at once), a few times, on one core; prints ms per micro-batch
of each layer and pass, largest first (the last chunk's loss included; "glue": the residual adds
and the Python between layers), then the same by op (what `bench train`'s time split uses),
and the optimizer step. `MPIHYBRID_KERNELS=numpy` profiles the numpy references instead.
--partition times every block of the whole model instead and prints the `model.partition` that
balances the measured seconds (a list for the job file), beside the FLOP-based "cost" split.
"""

from __future__ import annotations

import argparse
import time

from mpihybrid import _numba
from mpihybrid.comm.device import keep_freed_host_memory
from mpihybrid.config import load_job
from mpihybrid.nn.model import partition
from mpihybrid.nn.optim import build_optimizer
from mpihybrid.nn.profile import CATEGORIES, profile_chunk, timed_partition


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--partition", action="store_true", help="time every block, split")
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's malloc as it is (train() tells it to keep freed memory)",
    )
    args = parser.parse_args()
    if not args.default_malloc:
        keep_freed_host_memory()  # as train() does
    job = load_job(args.job, args.overrides, job_world(args.job, args.overrides))
    if args.partition:
        return print_partition(job, args.repeats)
    by_layer = profile_chunk(job.workload, args.chunk, args.repeats, key=lambda l, m: (repr(l), m))
    by_op = profile_chunk(job.workload, args.chunk, args.repeats)
    per_mb = sum(by_layer.values())
    from mpihybrid.nn.data import task_dims
    from mpihybrid.nn.model import build_stage

    stage = build_stage(job.model, *task_dims(job.data), args.chunk, job.workload.chunks, seed=0)
    optimizer = build_optimizer(job.train, stage.flat_params)
    optimizer.step(stage.flat_grads)  # warm-up (compiles)
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        optimizer.step(stage.flat_grads)
    opt = (time.perf_counter() - t0) / args.repeats
    print(f"kernels: {_numba.describe()}")
    print(f"chunk {args.chunk} of {job.workload.chunks}: {stage.num_params:,} parameters, "
          f"F+B+W {1e3 * per_mb:.1f} ms per micro-batch, {job.train.optimizer} step "
          f"{1e3 * opt:.1f} ms")  # fmt: skip
    for key, seconds in sorted(by_layer.items(), key=lambda kv: -kv[1]):
        name, method = key if isinstance(key, tuple) else (key, "")
        if seconds:
            print(f"  {name:<48} {method:<16} {1e3 * seconds:7.2f} ms")
    total = sum(by_op.values())
    print("by op (" + ", ".join(sorted(set(CATEGORIES.values()))) + ", loss, glue):")
    for key, seconds in sorted(by_op.items(), key=lambda kv: -kv[1]):
        print(f"  {key:<20} {1e3 * seconds:7.2f} ms  {100 * seconds / total:5.1f}%")


def print_partition(job, repeats: int) -> None:
    from mpihybrid.nn.data import task_dims
    from mpihybrid.nn.model import block_costs, build_blocks, chunk_ranges

    counts, seconds = timed_partition(job.workload, repeats)
    blocks = build_blocks(job.model, *task_dims(job.data))
    flops = block_costs(blocks)
    by_cost = chunk_ranges(job.model, blocks, job.workload.chunks)
    print(f"kernels: {_numba.describe()}; ms per micro-batch (F+B+W) and GFLOPs per row, by block:")
    for g, (s, f) in enumerate(zip(seconds, flops, strict=True)):
        print(f"  block {g:<3} {1e3 * s:7.2f} ms  {f / 1e9:6.3f}")

    def chunk_ms(ranges) -> str:
        return " / ".join(f"{1e3 * sum(seconds[r.start : r.stop]):.1f}" for r in ranges)

    measured = partition(seconds, job.workload.chunks)
    print(f"by measured time: model.partition = {counts} (chunks {chunk_ms(measured)} ms)")
    print(f"by FLOPs ('cost'): blocks {[len(r) for r in by_cost]} (chunks {chunk_ms(by_cost)} ms)")


def job_world(path: str, overrides: list[str]) -> int:
    """The world size the job's grid asks for (the profile itself runs in one process)."""
    from mpihybrid.config import build_job, load_table

    grid = build_job(load_table(path)).grid
    return grid.pp * max(grid.dp, 1)


if __name__ == "__main__":
    main()
