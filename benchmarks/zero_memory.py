"""Per-rank memory of the distributed optimizer and of recomputation: measured and predicted.

    mpiexec -n 2 python benchmarks/zero_memory.py jobs/gpt_bench.toml --set grid.pp=1 \
        --set grid.dp=2 --set train.global_batch=16 --set train.shard_optimizer=true

Trains the job once for --steps steps and prints per rank: the peak resident set over the
training steps (VmHWM, the trace's peak_rss_bytes), predict's memory (the repository's
clusters/local.toml), the pre-run estimate (train.memory), the optimizer state the rank holds
(its master copy included), the peak activation bytes the runtime counted in the last step
(trace rows' liveness) beside predict's, the most bytes the W caches of split backwards (the
Linear inputs and output gradients kept from a B to its W) held at once, and the mean step time
(a rough figure, not a benchmark: bench train --against pairs those). One job per launch: a
process keeps the memory numpy freed (keep_freed_host_memory), so a second run in it would count
the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from mpihybrid.config import load_job  # noqa: E402
from mpihybrid.nn.model import Stage  # noqa: E402
from mpihybrid.pipeline.liveness import replay_rows  # noqa: E402
from mpihybrid.predict.cluster import load_cluster  # noqa: E402
from mpihybrid.predict.model import predict  # noqa: E402
from mpihybrid.train import build as run_build  # noqa: E402
from mpihybrid.train import loop  # noqa: E402
from mpihybrid.train.memory import rank_estimate, reset_peak_rss  # noqa: E402

MIB = 1 << 20
CLUSTER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "clusters", "local.toml"
)


def measure(job, world) -> dict | None:
    """One training run; rank 0 gets every rank's figures."""
    state = {}
    build = run_build.build_run

    def spy(*a, **k):  # the optimizer state each rank holds, read from the run as built
        run = build(*a, **k)
        state["bytes"] = sum(
            v.nbytes + (getattr(o, "master", None) is not None and o.master.nbytes)
            for o in (st.optimizer for st in run.states.values())
            for v in o.state().values()
        )
        return run

    # the W caches: bytes each B hands to its W, while they wait
    held = {"now": 0, "peak": 0}
    sizes: dict[int, int] = {}
    backward_input, backward_weight = Stage.backward_input, Stage.backward_weight

    def spy_b(stage, *a, **k):
        dx, wcache = backward_input(stage, *a, **k)
        sizes[id(wcache)] = stage.activation_nbytes(wcache)
        held["now"] += sizes[id(wcache)]
        held["peak"] = max(held["peak"], held["now"])
        return dx, wcache

    def spy_w(stage, wcache, *a, **k):
        backward_weight(stage, wcache, *a, **k)
        held["now"] -= sizes.pop(id(wcache))

    run_build.build_run = spy
    Stage.backward_input, Stage.backward_weight = spy_b, spy_w
    reset_peak_rss()
    try:
        summary = loop.train(job, world, quiet=True)
    finally:
        run_build.build_run = build
        Stage.backward_input, Stage.backward_weight = backward_input, backward_weight
    states = world.gather(state["bytes"], root=0)
    wcaches = world.gather(held["peak"], root=0)
    if world.rank != 0:
        return None
    g = job.grid
    pp_of = [r % g.pp if g.order == "pipeline-inner" else r // g.dp for r in range(world.size)]
    predicted = predict(job, load_cluster(CLUSTER))["memory"]
    ev = summary.events  # every rank's rows (no trace file): the last step's activations
    last = ev[ev["step"] == ev["step"].max()]
    measured_acts = [
        replay_rows(last[last["rank"] == r]).peak_total_bytes for r in range(world.size)
    ]
    return {
        "peak_rss": summary.peak_rss_bytes,
        "predicted": [predicted[p]["total_bytes"] for p in pp_of],
        "predicted_activations": [predicted[p]["activation_bytes"] for p in pp_of],
        "activations": measured_acts,
        "estimate": [sum(rank_estimate(job, p).values()) for p in pp_of],
        "optimizer_state": states,
        "wcache_peak": wcaches,
        "step_s": summary.runtime_s / max(summary.steps - summary.start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    overrides = [*args.overrides, f"train.steps={args.steps}", "trace.path="]
    job = load_job(args.job, overrides, world.size)
    r = measure(job, world)
    if world.rank != 0:
        return
    if args.json:
        print(json.dumps({"overrides": args.overrides, **r}))
        return
    print("== " + " ".join(args.overrides))
    for rank, rss in enumerate(r["peak_rss"]):
        err = 100 * (r["predicted"][rank] / rss - 1)
        print(
            f"  rank {rank}: peak RSS {rss / MIB:7.1f} MiB, predicted "
            f"{r['predicted'][rank] / MIB:7.1f} ({err:+.1f} %), estimate "
            f"{r['estimate'][rank] / MIB:7.1f}, optimizer state "
            f"{r['optimizer_state'][rank] / MIB:6.1f} MiB, activations "
            f"{r['activations'][rank] / MIB:6.1f} MiB (predicted "
            f"{r['predicted_activations'][rank] / MIB:.1f}), W caches "
            f"{r['wcache_peak'][rank] / MIB:.1f} MiB, {1e3 * r['step_s']:.0f} ms/step"
        )


if __name__ == "__main__":
    main()
