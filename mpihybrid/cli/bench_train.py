"""Training throughput benchmark: tokens/s, busy fractions, FLOPs and the matmul roofline.

    mpiexec -n 2 mpihybrid bench train jobs/gpt_bench.toml
    mpiexec -n 2 mpihybrid bench train jobs/gpt_bench.toml --set train.schedule=1f1b --json
    mpiexec -n 2 mpihybrid bench train jobs/gpt_bench.toml --against train.schedule=zb-h1

Each repeat trains the job from scratch for `warmup + steps` steps and measures the last
`steps` (rank 0's clock, from the start of the first measured step to the end of the last,
the per-step metrics collective included). Reported:

    tokens/s       median over repeats (samples/s for data without tokens)
    step time      median measured step (trace.recorder.step_times: first start to last end)
    busy           per rank and per stage: compute time / measured wall time
    time split     per rank, of the measured wall time: GEMM (the rank's matmul FLOPs at its
                   measured GEMM rate, the roofline's), elementwise (the rest of its forward,
                   backward and weight passes), optimizer, communication (sends, receives,
                   all-reduce and waits for it, as traced)
    FLOPs/token    training FLOPs of the model (matmuls: forward, input and weight gradients)
    roofline       ranks x the float32 GEMM rate one core reaches on the model's own matmuls:
                   every rank at once runs every GEMM of one micro-batch through the whole model
                   (forward, dx, dW, the same shapes, a distinct weight array per layer as in
                   training), timed, median of repeats; the sum over ranks is the machine's
                   matmul roofline for this model. Measured right after each repeat of the job,
                   so each repeat's throughput is set against the roofline of its own minute:
                   `of roofline` is the median over repeats, each repeat's figure shown. `hot`
                   is the rate of the largest shape repeated on the same operands (the best a
                   core can do).
    memory         peak resident set per rank over the training steps (VmHWM, started over
                   before each repeat, read after its last step: neither evaluation nor the
                   roofline pass counts), the largest over repeats; peak activations per
                   stage, measured and predicted by the schedule
    against        (--against KEY=VALUE) the job with those overrides, run beside each repeat
                   (after it, then before the next: ABBA): its tokens/s, and this job's over it
                   repeat by repeat (pairs in time cancel most of a drifting machine's noise)
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from mpihybrid.cli.bench_split import (
    busy,
    format_parts,
    measured_wall,
    profile_chunks,
    rank_profiles,
    time_split,
)
from mpihybrid.config import Job, to_toml
from mpihybrid.nn.cost import gemm_flops, microbatch_rows, model_gemms, stage_work
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.layers import PASSES, Gemm
from mpihybrid.nn.model import block_costs, build_blocks
from mpihybrid.trace.recorder import step_times


def chunk_gemm_flops(job: Job) -> list[int]:
    """Matmul FLOPs of one micro-batch's forward + backward through each model chunk."""
    return [int(sum(w.flops(p) for p in PASSES)) for w in stage_work(job.workload)]


def measure_gemm_rate(gemms: list[Gemm], repeats: int = 5) -> float:
    """FLOP/s of running `gemms` in order, each on operands of its own (median of repeats)."""
    from mpihybrid.cli.bench_blas import gemm_pass_seconds

    return gemm_flops(gemms) / gemm_pass_seconds(gemms, repeats)


def hot_gemm_rate(gemm: Gemm, seconds: float = 0.3) -> float:
    """FLOP/s of one GEMM repeated on the same operands for about `seconds`."""
    b, m, k, n = gemm
    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((b, m, k), np.float32), rng.standard_normal((b, k, n), np.float32)
    out = np.empty((b, m, n), np.float32)
    np.matmul(a, w, out=out)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        np.matmul(a, w, out=out)
        count += 1
    return gemm_flops([gemm]) * count / (time.perf_counter() - start)


def _as_trace(job: Job, summary, world_size: int):
    """The run as an in-memory Trace, so the analysis of `mpihybrid analyze` applies as is."""
    from mpihybrid.trace.read import Trace
    from mpihybrid.train.tracing import layout_attrs

    steps = {"loss": np.array(summary.losses), "accuracy": np.array(summary.accuracies)}
    return Trace(summary.events, steps, to_toml(job), layout_attrs(job, world_size))


def _bench_job(job: Job, steps: int) -> Job:
    return dataclasses.replace(
        job,
        train=dataclasses.replace(job.train, steps=steps),
        trace=dataclasses.replace(job.trace, path="", events=True),
        checkpoint=dataclasses.replace(job.checkpoint, every=0, dir=""),
    )


def bench_train(
    job: Job,
    world: MPI.Comm,
    warmup: int,
    steps: int,
    repeats: int,
    *,
    against: tuple[Job, list[str]] | None = None,
    progress=None,
) -> dict | None:
    """Run the benchmark on every rank; rank 0 gets the results (progress: a line per repeat).

    against: (another job, the overrides that made it): each repeat also runs that job, after
    this one and before it in turn, so the two are compared pair by pair under the same drift.
    """
    # Over 60 lines because most of it is the one literal of the result (--json prints it):
    # its keys read in the order the report prints them.
    job = _bench_job(job, warmup + steps)
    other = _bench_job(against[0], warmup + steps) if against else None
    tokens = job.tokens_per_sample
    blocks = build_blocks(job.model, *task_dims(job.data))
    rows = microbatch_rows(job.workload)[1]
    gemms = model_gemms(job.workload)

    runs, other_walls, last, roofs, peak_rss = _run_repeats(
        job, other, world, warmup=warmup, repeats=repeats, gemms=gemms, progress=progress
    )
    chunk_profiles = profile_chunks(job, world)
    hot = hot_gemm_rate(max(gemms, key=lambda g: gemm_flops([g]))) if world.rank == 0 else 0.0
    if world.rank != 0:
        return None

    per_step = job.train.global_batch * tokens
    throughputs = [steps * per_step / run[0] for run in runs]
    median = statistics.median(throughputs)
    chosen = throughputs.index(median) if median in throughputs else 0
    wall, _, report, events = runs[chosen]
    rates = roofs[chosen]  # the GEMM rate of each rank right after the median repeat
    flops_per_token = sum(block_costs(blocks))  # per row: a token (gpt) or a sample (mlp)
    assert gemm_flops(gemms) == flops_per_token * rows, "GEMM list and cost model disagree"
    return {
        "job": _job_summary(job, per_step),
        "unit": "tokens" if tokens > 1 else "samples",
        "repeats": repeats,
        "warmup_steps": warmup,
        "measured_steps": steps,
        "throughput": median,
        "throughputs": throughputs,
        # the median over the repeats, as the throughput: with an even count the median is
        # between two repeats, and the first alone (the chosen one) may be the slow one
        "step_time": statistics.median(run[1] for run in runs),
        "step_times": [run[1] for run in runs],  # each repeat's median step
        "bubble": report["bubble"]["measured"],
        "bubble_predicted": report["bubble"]["formula"],
        "bubble_simulated": report["bubble"]["predicted"],
        "gemm_rate_hot": hot,
        "blas": blas_in_use(),
        **_roofline_figures(flops_per_token, throughputs, roofs, rates),
        **_busy_rows(job, report, events, warmup, wall),
        "time_split": time_split(
            events,
            first=warmup,
            wall=wall,
            ranks=report["ranks"],
            gemm=_gemm_seconds(job, report["ranks"], chunk_gemm_flops(job), rates, steps),
            profiles=rank_profiles(report["ranks"], chunk_profiles),
        ),
        "chunk_profiles": {str(c): p for c, p in sorted(chunk_profiles.items())},
        "peak_rss_bytes": [int(b) for b in peak_rss],
        "final_loss": float(last.losses[-1]) if last.losses else None,
        "against": _against(against, other_walls, throughputs, steps),
    }


def blas_in_use() -> str:
    """Which BLAS kernels the matmuls ran, and who chose them (mpihybrid/_blas.py)."""
    from mpihybrid._blas import CORE_VAR
    from mpihybrid.cli.bench_blas import openblas_core

    core = openblas_core()
    if not core:
        return "numpy's BLAS (not OpenBLAS)"
    chosen = os.environ.get(CORE_VAR)
    return f"OpenBLAS, {core} kernels" + (
        f" ({CORE_VAR}={chosen}: `mpihybrid bench blas --save` or the environment)"
        if chosen
        else " (OpenBLAS's own pick; `mpihybrid bench blas` times the others)"
    )


def _schedule_name(job: Job) -> str:
    """The schedule, and for train.schedule = "auto" what the search chose: the placement, who
    found it (the exact search, the greedy, or a built-in kept on a tie) and the split."""
    import json

    name, record = job.train.schedule, job.schedule.search
    if record is None:
        return name
    info = json.loads(record)
    return f"{name} (auto: {info['placement']} by {info['found_by']}, split {job.model.partition})"


def _job_summary(job: Job, per_step: int) -> dict:
    return {
        "pp": job.grid.pp,
        "dp": job.grid.dp,
        "schedule": _schedule_name(job),
        "microbatches": job.train.microbatches,
        "early_grad_send": job.train.early_grad_send,
        "merge_w": job.train.merge_w,
        "model": job.model.kind,
        "tokens_per_step": per_step,
    }


def _roofline_figures(
    flops_per_token: int, throughputs: list[float], roofs: list, rates: list[float]
) -> dict:
    """Achieved FLOP/s and the roofline: each repeat against the roofline measured right after
    it (the machine drifts between minutes), the median repeat's rates per rank."""
    rooflines = [float(sum(r)) for r in roofs]
    fractions = [flops_per_token * t / r for t, r in zip(throughputs, rooflines, strict=True)]
    return {
        "flops_per_token": flops_per_token,
        "achieved_flops": flops_per_token * statistics.median(throughputs),
        "gemm_rate_per_rank": [float(r) for r in rates],
        "roofline": float(sum(rates)),
        "roofline_fraction": statistics.median(fractions),
        "rooflines": rooflines,
        "roofline_fractions": fractions,
    }


def _gemm_seconds(
    job: Job, ranks: list[dict], chunk_flops: list[int], rates: list[float], steps: int
) -> dict[int, float]:
    """Seconds each rank's matmuls take over the measured steps at its measured GEMM rate."""
    per_step = job.train.microbatches * steps
    return {
        # a vocabulary share (model.vocab_parallel, index past the stages) is not counted here
        r["rank"]: per_step
        * sum(chunk_flops[s] for s in r["stages"] if s < len(chunk_flops))
        / rates[r["rank"]]
        for r in ranks
        if rates[r["rank"]] > 0
    }


def _run_repeats(
    job: Job,
    other: Job | None,
    world: MPI.Comm,
    *,
    warmup: int,
    repeats: int,
    gemms: list[Gemm],
    progress=None,
):
    """Train the job `repeats` times (and `other` beside each, ABBA); on rank 0 the runs as
    (wall, median step time, analysis, events), the other job's walls, the last Summary, per
    repeat every rank's GEMM rate measured right after it, and every rank's peak resident set
    over the training steps (the largest of the repeats)."""
    from mpihybrid.analysis.metrics import analyze
    from mpihybrid.train.loop import train
    from mpihybrid.train.memory import reset_peak_rss

    runs, other_walls, summary, roofs, peak_rss = [], [], None, [], None

    def fresh_train(which: Job):
        gc.collect()  # the last run's cycles are freed now, not inside this run's steps
        world.Barrier()
        return train(which, world, quiet=True)

    def run_other() -> None:
        other_summary = fresh_train(other)
        if world.rank == 0:
            other_walls.append(measured_wall(other_summary.events, warmup))

    for i in range(repeats):
        # pairs in ABBA order: whatever running first or second does to a run (the heap the
        # run before left, the roofline pass) falls on both jobs alike over two repeats
        if other is not None and i % 2:
            run_other()
        reset_peak_rss()  # the last repeat's roofline pass and the other job do not count
        summary = fresh_train(job)
        if world.rank == 0:
            mine = summary.peak_rss_bytes
            peak_rss = mine if peak_rss is None else list(map(max, peak_rss, mine))
        # the roofline: every rank measures at the same time, as every core is busy in training
        world.Barrier()
        roofs.append(world.gather(measure_gemm_rate(gemms), root=0))
        if world.rank == 0:
            wall = measured_wall(summary.events, warmup)
            measured = [t for s, t in step_times(summary.events).items() if s >= warmup]
            report = analyze(_as_trace(job, summary, world.size), skip_steps=warmup)
            runs.append((wall, statistics.median(measured), report, summary.events))
            if progress is not None:
                step_ms = 1e3 * runs[-1][1]
                progress(f"[{len(runs)}/{repeats}] repeat {len(runs)}: {step_ms:.1f} ms/step")
        if other is not None and not i % 2:
            run_other()
    return runs, other_walls, summary, roofs, peak_rss


def _busy_rows(job: Job, report: dict, events: np.ndarray, warmup: int, wall: float) -> dict:
    """The "ranks" and "stages" entries: busy fractions, activations measured and predicted."""
    busy_rank, busy_stage = busy(events, warmup, wall)
    ranks = [
        {"rank": r["rank"], "stages": r["stages"], "busy": busy_rank.get(r["rank"], 0.0)}
        for r in report["ranks"]
    ]
    stages = [
        {
            "stage": s["stage"],
            "busy": busy_stage.get(s["stage"], 0.0) / job.grid.dp,
            "peak_inflight": s["peak_inflight"],
            "predicted_peak_inflight": s["predicted_peak_inflight"],
            "peak_activation_bytes": s["peak_activation_bytes"],
        }
        for s in report["stages"]
    ]
    return {"ranks": ranks, "stages": stages}


def _against(against, walls: list[float], throughputs: list[float], steps: int) -> dict | None:
    """The other job's throughput per repeat, and this job's over it, repeat by repeat."""
    if against is None:
        return None
    other = against[0]
    theirs = [steps * other.train.global_batch * other.tokens_per_sample / wall for wall in walls]
    ratios = [mine / other for mine, other in zip(throughputs, theirs, strict=True)]
    return {
        "overrides": against[1],
        "throughput": statistics.median(theirs),
        "throughputs": theirs,
        "ratios": ratios,
        "ratio": statistics.median(ratios),
    }


def format_bench(result: dict) -> str:
    from mpihybrid.units import human_bytes

    j, unit = result["job"], result["unit"]
    g = 1e9
    lines = [
        f"== bench train: {j['model']}, pp={j['pp']} x dp={j['dp']}, {j['schedule']}, "
        f"M={j['microbatches']}, {j['tokens_per_step']} {unit}/step"
        + (", gradients sent before W" if j["early_grad_send"] else "")
        + (f", W merged in {j['merge_w']}s; " if j.get("merge_w", 1) > 1 else "; ")
        + f"{result['repeats']} repeats of {result['warmup_steps']} warm-up + "
        f"{result['measured_steps']} measured steps",
        f"throughput     {result['throughput']:,.0f} {unit}/s (median; repeats: "
        + ", ".join(f"{t:,.0f}" for t in result["throughputs"])
        + ")",
        f"step time      {1e3 * result['step_time']:.1f} ms (median)",
        f"bubble         {result['bubble']:.3f} measured, {result['bubble_simulated']:.3f} "
        f"simulated with the measured F/B/W, {result['bubble_predicted']:.3f} by the schedule's "
        "formula",
        f"{'FLOPs/' + unit[:-1]:<15}{result['flops_per_token'] / 1e6:,.1f} M (training: forward + "
        "backward matmuls)",
        f"achieved       {result['achieved_flops'] / g:.1f} GFLOP/s",
        f"roofline       {result['roofline'] / g:.1f} GFLOP/s = "
        + " + ".join(f"{r / g:.1f}" for r in result["gemm_rate_per_rank"])
        + " (the model's GEMMs, every rank at once; one core, hot: "
        + f"{result['gemm_rate_hot'] / g:.1f})",
        f"blas           {result['blas']}",
        f"of roofline    {100 * result['roofline_fraction']:.1f}% (median; repeats, each against "
        "the roofline measured right after it: "
        + ", ".join(
            f"{100 * f:.1f}% of {r / g:.1f}"
            for f, r in zip(result["roofline_fractions"], result["rooflines"], strict=True)
        )
        + ")",
        "busy           "
        + ", ".join(f"rank {r['rank']} {100 * r['busy']:.0f}%" for r in result["ranks"]),
        "time split     "
        + "; ".join(
            f"rank {t['rank']}: GEMM {100 * t['gemm']:.0f}%, elementwise "
            f"{100 * t['elementwise']:.0f}%, optimizer {100 * t['optimizer']:.0f}%, "
            f"communication {100 * t['communication']:.0f}% (gradients "
            f"{100 * t['exposed_allreduce']:.0f}% exposed, {100 * t['allreduce_hidden']:.0f}% "
            "of their ring + optimizer hidden)"
            for t in result["time_split"]
        )
        + " (of wall; GEMM at the rank's measured rate)",
        *format_parts(result["time_split"]),
        "stages         "
        + ", ".join(
            f"{s['stage']}: busy {100 * s['busy']:.0f}%, activations {s['peak_inflight']} "
            f"(predicted {s['predicted_peak_inflight']}), "
            f"{human_bytes(s['peak_activation_bytes'])}"
            for s in result["stages"]
        ),
        "peak memory    "
        + ", ".join(f"rank {r} {human_bytes(b)}" for r, b in enumerate(result["peak_rss_bytes"])),
    ]
    other = result["against"]
    if other:
        lines += [
            f"against        {' '.join(other['overrides'])}: {other['throughput']:,.0f} {unit}/s "
            "(median; repeats: " + ", ".join(f"{t:,.0f}" for t in other["throughputs"]) + ")",
            f"this / that    {other['ratio']:.3f} (median of the repeats paired in time: "
            + ", ".join(f"{r:.3f}" for r in other["ratios"])
            + ")",
        ]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: mpiexec -n N mpihybrid bench train JOB")
