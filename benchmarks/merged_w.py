"""A merged weight-gradient pass (Stage.backward_weight_merged) against K separate ones
(Stage.backward_weight), on the two stages of jobs/gpt_bench.toml, interleaved in one process.

    OMP_NUM_THREADS=1 python benchmarks/merged_w.py                   # 64 and 128 rows, K = 4
    OMP_NUM_THREADS=1 python benchmarks/merged_w.py --rows 128 --merge 8 --rounds 40

For each micro-batch size (--rows: sequences of 64 tokens) the job runs K micro-batches a step;
each chunk's K forwards and input gradients run once (nn/profile.stage_wcaches: the last chunk's
loss, a constant gradient into the others), then every round zeroes the gradients and times the
K separate weight passes, then zeroes them and times the merged one (its gather counted). Printed
per chunk: median ms of each, merged/separate, and the worst |merged - separate| of a tensor
over its largest |value| (the merged GEMM sums in another order).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from stage_profile import job_world

from mpihybrid.comm.device import keep_freed_host_memory
from mpihybrid.config import load_job
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.model import build_stage
from mpihybrid.nn.profile import chunk_inputs, chunk_loss, stage_wcaches

JOB = "jobs/gpt_bench.toml"
SEQ = 64  # gpt_bench's data.seq_len: the rows of one sequence


def worst_difference(stage, a: np.ndarray, b: np.ndarray) -> float:
    """max over the stage's tensors of max |a - b| / max |b|."""
    bounds = [*stage.tensor_offsets, stage.num_params]
    return max(
        float(np.abs(a[lo:hi] - b[lo:hi]).max() / max(np.abs(b[lo:hi]).max(), 1e-30))
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    )


def time_chunk(work, chunk: int, rounds: int) -> tuple[float, float, float]:
    """(separate ms, merged ms, worst difference) of one chunk's K weight passes."""
    stage = build_stage(work.model, *task_dims(work.data), chunk, work.chunks, seed=work.seed)
    inputs, targets = chunk_inputs(work, chunk)
    loss = chunk_loss(work) if chunk == work.chunks - 1 else None
    wcaches = stage_wcaches(stage, inputs, targets, loss, chunk == 0)
    times: dict[str, list[float]] = {"separate": [], "merged": []}
    for _ in range(rounds + 1):  # the first round warms up
        stage.zero_grad()
        start = time.perf_counter()
        for wc in wcaches:
            stage.backward_weight(wc)
        times["separate"].append(time.perf_counter() - start)
        separate = stage.flat_grads.copy()
        stage.zero_grad()
        start = time.perf_counter()
        stage.backward_weight_merged(wcaches)
        times["merged"].append(time.perf_counter() - start)
    sep, merged = (1e3 * statistics.median(times[k][1:]) for k in ("separate", "merged"))
    return sep, merged, worst_difference(stage, stage.flat_grads, separate)


def refuse(message: str) -> None:
    """A bad option: one line on stderr, exit status 2 (argparse's, without its usage lines)."""
    print(f"merged_w.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = refuse
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128],
                        help=f"rows of a micro-batch, multiples of {SEQ}")  # fmt: skip
    parser.add_argument("--merge", type=int, default=4, metavar="K", help="micro-batches merged")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    bad = [r for r in args.rows if r < SEQ or r % SEQ]
    if bad or args.merge < 2 or args.rounds < 1:
        refuse(f"--rows are positive multiples of {SEQ} (got {args.rows}), --merge at least 2 "
               f"(got {args.merge}), --rounds at least 1 (got {args.rounds})")  # fmt: skip
    keep_freed_host_memory()  # as train() does
    k = args.merge
    print(f"{JOB}: K = {k} micro-batches, median of {args.rounds} rounds")
    print(f"  {'rows':>4}  {'chunk':>5}  {'separate ms':>11}  {'merged ms':>9}"
          f"  {'merged/separate':>15}  {'worst diff':>10}")  # fmt: skip
    for rows in args.rows:
        sets = [f"train.microbatches={k}", f"train.global_batch={k * rows // SEQ}"]
        work = load_job(JOB, sets, job_world(JOB, sets)).workload
        for chunk in range(work.chunks):
            sep, merged, worst = time_chunk(work, chunk, args.rounds)
            print(f"  {rows:>4}  {chunk:>5}  {sep:11.3f}  {merged:9.3f}  {merged / sep:15.3f}"
                  f"  {worst:10.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
