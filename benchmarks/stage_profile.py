"""Where one stage's time goes, layer type by layer type: forward, input and weight gradient.

    python benchmarks/stage_profile.py jobs/gpt_bench.toml            # chunk 0 of pp
    python benchmarks/stage_profile.py jobs/gpt_bench.toml --chunk 1
    python benchmarks/stage_profile.py jobs/gpt_bench.toml --default-malloc  # without mallopt

Runs M micro-batches of forward, then backward_input + backward_weight, as a pipeline stage
does (activations of all M alive at once), a few times, on one core; prints ms per micro-batch
summed over the layers of each type, largest first (the last chunk's loss included), and the
optimizer step. `MPIHYBRID_KERNELS=numpy` profiles the numpy references instead of the kernels.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from mpihybrid import _numba
from mpihybrid.comm.device import keep_freed_host_memory
from mpihybrid.config import load_job
from mpihybrid.nn.data import build_task, microbatches
from mpihybrid.nn.layers import SoftmaxCrossEntropy
from mpihybrid.nn.model import build_stage
from mpihybrid.nn.optim import build_optimizer
from mpihybrid.nn.transformer import Residual


def timed(layer, totals: dict) -> None:
    """Wrap the layer's passes (and its branch's, for a Residual) with timers."""
    if isinstance(layer, Residual):
        for sub in layer.branch:
            timed(sub, totals)
        return
    name = repr(layer)
    for method in ("forward", "backward_input", "backward_weight"):
        inner = getattr(layer, method)

        def wrapper(*args, _inner=inner, _key=(name, method)):
            start = time.perf_counter()
            out = _inner(*args)
            totals[_key] += time.perf_counter() - start
            return out

        setattr(layer, method, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's malloc as it is (train() tells it to keep freed memory)",
    )
    args = parser.parse_args()
    if not args.default_malloc:
        keep_freed_host_memory()  # as train() does
    job = load_job(args.job, [], job_world(args.job))
    task = build_task(job.data)
    chunks = job.grid.pp * job.train.virtual_stages
    stage = build_stage(job.model, task.in_features, task.num_classes, args.chunk, chunks, 0)
    m = job.train.microbatches
    x, y = task.global_batch(0, job.train.global_batch // job.grid.dp)
    batches = microbatches(x, y, 0, 1, m)
    rng = np.random.default_rng(0)
    if args.chunk > 0:  # a later chunk gets activations, not tokens
        shape = (len(batches[0][0]), *([task.in_features] if job.model.kind == "gpt" else []))
        width = job.model.hidden if job.model.kind == "gpt" else stage.layers[0].in_features
        inputs = [rng.standard_normal((*shape, width)).astype(np.float32) for _ in range(m)]
    else:
        inputs = [b[0] for b in batches]
    totals: dict = collections.defaultdict(float)
    for layer in stage.layers:
        timed(layer, totals)
    last = args.chunk == chunks - 1
    loss_fn = SoftmaxCrossEntropy()
    for repeat in range(args.repeats + 1):
        if repeat == 1:  # the first pass warms up
            totals.clear()
            start = time.perf_counter()
        caches = [stage.forward(xb) for xb in inputs]
        for (out, cache), (_, targets) in zip(caches, batches, strict=True):
            dy = _loss_gradient(loss_fn, out, targets, totals) if last else np.full_like(out, 1e-3)
            _, wcache = stage.backward_input(dy, cache, need_dx=args.chunk > 0)
            stage.backward_weight(wcache)
    per_mb = (time.perf_counter() - start) / args.repeats / m
    optimizer = build_optimizer(job.train, stage.flat_params)
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        optimizer.step(stage.flat_grads)
    opt = (time.perf_counter() - t0) / args.repeats
    print(f"kernels: {_numba.describe()}")
    print(f"chunk {args.chunk} of {chunks}: {stage.num_params:,} parameters, "
          f"F+B+W {1e3 * per_mb:.1f} ms per micro-batch, {job.train.optimizer} step "
          f"{1e3 * opt:.1f} ms")  # fmt: skip
    for (name, method), seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        if seconds:
            print(f"  {name:<28} {method:<16} {1e3 * seconds / args.repeats / m:7.2f} ms")


def _loss_gradient(loss_fn, logits: np.ndarray, targets: np.ndarray, totals: dict) -> np.ndarray:
    """The loss's forward and backward on the logits (in place, as the runtime does), timed."""
    start = time.perf_counter()
    _, cache = loss_fn.forward(logits, targets)
    loss_fn.correct(cache)
    dy = loss_fn.backward(cache)
    totals[("SoftmaxCrossEntropy", "forward+backward")] += time.perf_counter() - start
    return dy


def job_world(path: str) -> int:
    """The world size the job's grid asks for (the profile itself runs in one process)."""
    from mpihybrid.config import build_job, load_table

    grid = build_job(load_table(path)).grid
    return grid.pp * max(grid.dp, 1)


if __name__ == "__main__":
    main()
