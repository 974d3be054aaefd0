"""Calibrate `mpihybrid predict` on one local run, then predict other local runs and measure them
with `bench train` in the same sitting: the table of step-time and memory errors.

    OMP_NUM_THREADS=1 python benchmarks/predict_validation.py              # the full table
    OMP_NUM_THREADS=1 python benchmarks/predict_validation.py --quick      # 3 runs (the test's)
    python benchmarks/predict_validation.py --json runs/validation.json    # also every figure
    python benchmarks/predict_validation.py --cluster-out clusters/local.toml  # keep the fit

1. `mpiexec -n 2 mpihybrid train CALIBRATION --trace DIR/cal.h5` (the GPT benchmark, pp=2,
   1F1B, M=4), then `mpihybrid predict ... --calibrate DIR/cal.h5 --cluster-out DIR/local.toml`.
2. For every case: `mpiexec -n PP*DP mpihybrid bench train JOB --set ... --json` (median step of
   the measured steps) and `mpihybrid predict JOB --set ... --cluster DIR/local.toml --json`.
Step-time error = predicted / measured - 1. Memory: the largest predicted rank total against the
largest peak RSS `bench train` measured over the training steps (VmHWM, neither its evaluation
nor its roofline pass); activations: the predicted per-stage peak against the runtime's own
count.

The machine drifts (+-10-20% minute to minute on 2 shared cores): the figures hold for one
sitting. Every run also says how many cores something else took meanwhile (other processes and
the hypervisor's steal: /proc/stat's busy time less the run's own CPU time); a run during which
that exceeded --quiet-below (0.2 cores) is run again, at most --retries (2) times, and the
table keeps every try's step beside the kept one. The calibration is retried the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT, MLP = "jobs/gpt_bench.toml", "jobs/bench_pp2.toml"
CALIBRATION = (GPT, ["train.steps=20"])  # 19 measured steps: a few seconds of a shared machine


def _mlp(pp: int, dp: int, schedule: str, m: int, codec: str = "fp32", v: int = 1) -> tuple:
    # the MLP keeps 256-row micro-batches (as `mpihybrid sweep` does): the batch grows with M, dp
    sets = [f"grid.pp={pp}", f"grid.dp={dp}", f"train.schedule={schedule}",
            f"train.microbatches={m}", f"train.global_batch={256 * m * dp}", f"comm.codec={codec}",
            f"train.virtual_stages={v}"]  # fmt: skip
    return (MLP, sets)


def _gpt(pp: int, dp: int, schedule: str, m: int, codec: str = "fp32") -> tuple:
    sets = [f"grid.pp={pp}", f"grid.dp={dp}", f"train.schedule={schedule}",
            f"train.microbatches={m}", f"train.global_batch={2 * m * dp}",
            f"comm.codec={codec}"]  # fmt: skip
    return (GPT, sets)


CASES = [
    *(_mlp(2, 1, s, 4) for s in ("naive", "gpipe", "1f1b", "zb-h1")),
    _mlp(2, 1, "interleaved-1f1b", 4, v=2),
    _mlp(2, 1, "1f1b", 2),
    _mlp(2, 1, "1f1b", 8),
    _mlp(1, 1, "1f1b", 4),
    _mlp(1, 2, "1f1b", 4),
    _mlp(1, 2, "1f1b", 4, "int8"),
    _gpt(2, 1, "1f1b", 4),
    _gpt(2, 1, "zb-h1", 4),
    _gpt(2, 1, "gpipe", 8),
    _gpt(1, 1, "1f1b", 4),
    _gpt(1, 2, "1f1b", 2, "int8"),
]
QUICK = [_mlp(2, 1, "zb-h1", 4), _mlp(1, 2, "1f1b", 2, "int8"), _gpt(2, 1, "gpipe", 2)]


def _cpu_seconds() -> tuple[float, float]:
    """(busy core-seconds of the whole machine since boot, /proc/stat, the hypervisor's steal
    included; CPU seconds of this process's children that have ended)."""
    with open("/proc/stat") as fh:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, fh.readline().split()[1:9]
        )
    times = os.times()
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return busy, times.children_user + times.children_system


def _run(cmd: list[str]) -> tuple[str, float]:
    """(stdout, cores that something else took on average meanwhile: other processes and the
    hypervisor's steal, from the machine's busy time less this command's own CPU time)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    busy0, ours0, t0 = *_cpu_seconds(), time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    busy1, ours1, t1 = *_cpu_seconds(), time.perf_counter()
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return out.stdout, max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (t1 - t0)


def _sets(sets: list[str]) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


def calibrate(workdir: Path, quiet: float, retries: int) -> dict:
    """Train the calibration run and fit the cluster file, again (up to `retries` times) while
    something else took more than `quiet` cores of the machine meanwhile: the cluster file, the
    run's median step after the first, what else ran (cores), the attempts."""
    from mpihybrid.trace.file import load
    from mpihybrid.trace.recorder import step_times

    job, sets = CALIBRATION
    trace, cluster = workdir / "cal.h5", workdir / "local.toml"
    attempts, others = 0, float("inf")
    while attempts <= retries and others > quiet:
        _, others = _run(["mpiexec", "-n", "2", "mpihybrid", "train", job, *_sets(sets),
                          "--quiet", "--trace", str(trace), "--overwrite"])  # fmt: skip
        _, fitting = _run(["mpihybrid", "predict", job, "--calibrate", str(trace),
                           "--cluster-out", str(cluster)])  # fmt: skip
        others, attempts = max(others, fitting), attempts + 1
    steps = step_times(load(trace).events)
    step = statistics.median(t for s, t in steps.items() if s >= 1)
    return {"cluster": cluster, "step_s": step, "other_load": others, "attempts": attempts}


def spread(rows: list[dict], calibration_step: float) -> str:
    """The run-to-run spread of this sitting: the calibration's configuration (its M and batch)
    measured twice, by the calibration run and by `bench train` later."""
    for r in rows:
        if r["job"] == GPT and _label(r) == "gpt pp=2 dp=1 1f1b M=4 fp32":
            again = r["measured_step_s"]
            return (f"the calibration's configuration measured twice in this sitting: "
                    f"{1e3 * calibration_step:.1f} ms (calibration run, median of its steps "
                    f"after the first) and {1e3 * again:.1f} ms (bench train): "
                    f"{100 * (again / calibration_step - 1):+.1f}%")  # fmt: skip
    return ""


def measure_and_predict(
    case: tuple, cluster: Path, warmup: int, steps: int, quiet: float, retries: int
) -> dict:
    """`bench train` of the case (again, up to `retries` times, while something else took more
    than `quiet` cores meanwhile; every try is kept) and `mpihybrid predict` of it."""
    job, sets = case
    world = int(sets[0].split("=")[1]) * int(sets[1].split("=")[1])
    tries = []  # (measured, cores something else took meanwhile)
    while len(tries) <= retries and (not tries or tries[-1][1] > quiet):
        out, others = _run(["mpiexec", "-n", str(world), "mpihybrid", "bench", "train", job,
                            *_sets(sets), "--warmup", str(warmup), "--steps", str(steps),
                            "--repeats", "1", "--json"])  # fmt: skip
        tries.append((json.loads(out), others))
    measured, others = tries[-1]
    out, _ = _run(["mpihybrid", "predict", job, *_sets(sets), "--cluster", str(cluster), "--json"])
    predicted = json.loads(out)
    act_measured = [s["peak_activation_bytes"] for s in measured["stages"]]
    act_predicted = [0] * len(act_measured)
    for m in predicted["memory"]:
        for s, nbytes in m["activation_bytes_per_stage"].items():
            act_predicted[int(s)] = nbytes
    rss = max(measured["peak_rss_bytes"])
    return {
        "job": job,
        "sets": sets,
        "measured_step_s": measured["step_time"],
        "predicted_step_s": predicted["step_time_s"],
        "step_error": predicted["step_time_s"] / measured["step_time"] - 1,
        "measured_bubble": measured["bubble"],
        "predicted_bubble": predicted["bubble"],
        "measured_rss_bytes": rss,
        "predicted_memory_bytes": predicted["peak_memory_bytes"],
        "memory_error": predicted["peak_memory_bytes"] / rss - 1,
        "other_load": others,
        "tries": [{"step_s": m["step_time"], "other_load": o} for m, o in tries],
        "activation_measured": act_measured,
        "activation_predicted": act_predicted,
    }


def _label(row: dict) -> str:
    s = dict(x.split("=", 1) for x in row["sets"])
    model = "gpt" if row["job"] == GPT else "mlp"
    v = f" v={s['train.virtual_stages']}" if s.get("train.virtual_stages", "1") != "1" else ""
    return (f"{model} pp={s['grid.pp']} dp={s['grid.dp']} {s['train.schedule']}{v} "
            f"M={s['train.microbatches']} {s['comm.codec']}")  # fmt: skip


def format_table(rows: list[dict]) -> str:
    lines = [
        "| run | step ms measured / predicted | error | bubble measured / predicted "
        "| peak RSS MiB measured / predicted | error | other load, tries |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tries = ", ".join(f"{1e3 * t['step_s']:.0f} ms at {t['other_load']:.2f}"
                          for t in r["tries"][:-1])  # fmt: skip
        lines.append(
            f"| {_label(r)} | {1e3 * r['measured_step_s']:.1f} / {1e3 * r['predicted_step_s']:.1f}"
            f" | {100 * r['step_error']:+.0f}% | {r['measured_bubble']:.3f} / "
            f"{r['predicted_bubble']:.3f} | {r['measured_rss_bytes'] / 2**20:.0f} / "
            f"{r['predicted_memory_bytes'] / 2**20:.0f} | {100 * r['memory_error']:+.0f}% | "
            f"{r['other_load']:.2f}" + (f" (before: {tries})" if tries else "") + " |"
        )
    lines.append("")
    lines.append(summary(rows)["text"])
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["step_error"]) for r in rows]
    memory = [abs(r["memory_error"]) for r in rows]
    exact = all(r["activation_measured"] == r["activation_predicted"] for r in rows)
    out = {
        "median_step_error": statistics.median(errors),
        "worst_step_error": max(errors),
        "worst_memory_error": max(memory),
        "activations_exact": exact,
    }
    out["text"] = (
        f"step time: median |error| {100 * out['median_step_error']:.1f}%, worst "
        f"{100 * out['worst_step_error']:.1f}% over {len(rows)} runs; peak memory: worst "
        f"{100 * out['worst_memory_error']:.1f}%; activations per stage equal to the runtime's "
        f"count: {'all' if exact else 'NOT all'}"
    )
    return out


def keep_cluster(path: Path, fitted: str, started: str, loads: tuple[float, float]) -> None:
    """Write the sitting's fitted cluster file with a header that says how it was made."""
    job, sets = CALIBRATION
    header = [
        f"This machine, fitted by benchmarks/predict_validation.py, started {started}",
        f"(load average {loads[0]:.2f} at the start, {loads[1]:.2f} at the end): the calibration",
        f"  mpiexec -n 2 mpihybrid train {job} {' '.join('--set ' + x for x in sets)} "
        "--trace cal.h5",
        f"  mpihybrid predict {job} --calibrate cal.h5",
        "The README's validation table comes from the same sitting. Times drift by +-10-20%",
        "minute to minute on a shared 2-core machine: calibrate and compare in one sitting.",
    ]
    body = "\n".join(line for line in fitted.splitlines() if not line.startswith("# "))
    path.write_text("".join(f"# {x}\n" for x in header) + body.lstrip() + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the test's 3 runs")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.2,
        metavar="CORES",
        help="a run during which something else took more cores is run again",
    )
    parser.add_argument("--retries", type=int, default=2, help="at most this many times")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    parser.add_argument("--cluster-out", metavar="PATH", help="keep the fitted cluster file here")
    args = parser.parse_args()  # fmt: skip
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()
    print(f"load average at the start (1, 5, 15 min): {load_start}")
    with tempfile.TemporaryDirectory() as tmp:
        cal = calibrate(Path(tmp), args.quiet_below, args.retries)
        rows = [
            measure_and_predict(case, cal["cluster"], args.warmup, args.steps, args.quiet_below,
                                args.retries)
            for case in (QUICK if args.quick else CASES)
        ]  # fmt: skip
        fitted = cal["cluster"].read_text()
    print(format_table(rows))
    print(f"calibration: {cal['attempts']} run(s), the kept one with {cal['other_load']:.2f} "
          "cores taken by something else")  # fmt: skip
    print(spread(rows, cal["step_s"]))
    load_end = os.getloadavg()
    print(f"load average at the end (1, 5, 15 min): {load_end}")
    if args.cluster_out:
        keep_cluster(Path(args.cluster_out), fitted, started, (load_start[0], load_end[0]))
    if args.json:
        cal = {k: v for k, v in cal.items() if k != "cluster"}
        Path(args.json).write_text(json.dumps(
            {"rows": rows, "summary": summary(rows), "cluster": fitted, "calibration": cal},
            indent=1,
        ))  # fmt: skip


if __name__ == "__main__":
    main()
