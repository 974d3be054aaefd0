"""What the pipeline runtime costs per action, measured with a tiny GPT whose layers take
microseconds, so what is left is the runtime's own Python and, with pp > 1, MPI's latency.

    python benchmarks/runtime_overhead.py                  # pp = 1: bookkeeping per action
    mpiexec -n 2 python benchmarks/runtime_overhead.py     # pp = 2: per action, messages included

pp = 1: the same micro-batches go through `PipelineRuntime.run_step` and through a plain loop
that calls the same stage and loss methods in the same order; (runtime - loop) / actions is the
runtime's overhead per action (dispatch, bookkeeping, trace events).
pp = 2: (step time - time inside F and B) / actions, per rank (the larger): what each action
costs beyond its compute -- the runtime, the messages and waiting for the other stage.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mpi4py import MPI

from mpihybrid.config import load_job
from mpihybrid.nn.data import build_task, microbatches
from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.model import boundary_shapes, build_stage
from mpihybrid.pipeline.runtime import PipelineRuntime
from mpihybrid.pipeline.schedules import Placement, build_schedule, lower
from mpihybrid.trace.recorder import KIND, Recorder

TINY = [
    "model.kind='gpt'",
    "model.hidden=8",
    "model.heads=2",
    "model.ffn=16",
    "data.kind='random-tokens'",
    "data.vocab=16",
    "data.seq_len=4",
    "train.schedule='1f1b'",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200, help="steps; the first tenth warm up")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: needs at least 2 (one to warm up, one to time)")
    warmup = max(1, args.steps // 10)  # the first steps compile and fault memory in
    world = MPI.COMM_WORLD
    pp, m = world.Get_size(), args.microbatches
    job = load_job(
        None,
        TINY
        + [f"grid.pp={pp}", "grid.dp=1", f"model.depth={pp}", f"train.microbatches={m}"]
        + [f"train.global_batch={m}"],
        pp,
    )
    task = build_task(job.data)
    placement = Placement.loop(pp)
    stages = {
        s: build_stage(job.model, task.in_features, task.num_classes, s, pp, seed=0)
        for s in placement.stages_of(world.rank)
    }
    actions = lower(build_schedule("1f1b", pp, m, 1), placement)[world.rank]
    shapes = boundary_shapes(job.model, task.in_features, task.num_classes, pp, 1)
    recorder = Recorder(world.rank, 0, capacity=(len(actions) + 8) * (args.steps + 1))
    runtime = PipelineRuntime(
        world,
        stages,
        actions,
        job.runtime_settings(),
        placement=placement,
        shapes=shapes,
        recorder=recorder,
    )
    x, y = task.global_batch(0, m)
    batches = microbatches(x, y, 0, 1, m)

    def runtime_step(step: int) -> float:
        world.Barrier()
        start = time.perf_counter()
        runtime.run_step(step, batches)
        return time.perf_counter() - start

    times = [runtime_step(step) for step in range(args.steps)][warmup:]
    if pp > 1:
        ev = recorder.events
        ev = ev[(ev["step"] >= warmup) & (ev["kind"] != KIND["step"])]
        compute = ev[(ev["kind"] == KIND["forward"]) | (ev["kind"] == KIND["backward"])]
        inside = float((compute["end"] - compute["start"]).sum()) / len(times)
        per_action = (statistics.median(times) - inside) / len(actions)
        worst = world.allreduce(per_action, op=MPI.MAX)
        if world.rank == 0:
            print(
                f"pp={pp}, M={m}: {len(actions)} actions per rank per step, median step "
                f"{1e6 * statistics.median(times):.0f} us -> {1e6 * worst:.1f} us per action "
                "beyond compute (runtime, messages, waiting)"
            )
        return

    stage, loss_fn = stages[0], model_kind(job.model.kind).loss()  # what the runtime computes

    def plain_step() -> float:
        start = time.perf_counter()
        for xb, yb in batches:
            out, cache = stage.forward(xb)
            _, lcache = loss_fn.forward(out, yb)
            loss_fn.correct(lcache)
            stage.backward(loss_fn.backward(lcache, 1.0 / m), cache, need_dx=False)
        return time.perf_counter() - start

    plain = statistics.median([plain_step() for _ in range(args.steps)][warmup:])
    ran = statistics.median(times)
    print(
        f"pp=1, M={m}: {len(actions)} actions per step; runtime {1e6 * ran:.0f} us, "
        f"plain loop {1e6 * plain:.0f} us -> overhead {1e6 * (ran - plain) / len(actions):.1f} us "
        "per action"
    )


if __name__ == "__main__":
    main()
