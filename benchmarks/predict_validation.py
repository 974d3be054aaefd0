"""Calibrate `mpihybrid predict` on one local run, then predict other local runs and measure them
with `bench train` in the same sitting: the table of step-time and memory errors, and the
recommender's first pick against the best measured of the layouts it ranked.

In phases of a few minutes each (others wait on the lock meanwhile), one work directory:

    W=runs/validation; L="flock -x /tmp/mh_heavy.lock"
    $L python benchmarks/predict_validation.py --workdir $W calibrate
    $L python benchmarks/predict_validation.py --workdir $W cases --only 0:9
    $L python benchmarks/predict_validation.py --workdir $W cases --only 9:
    $L python benchmarks/predict_validation.py --workdir $W search --world 2
    $L python benchmarks/predict_validation.py --workdir $W search --world 4
    python benchmarks/predict_validation.py --workdir $W memory    # only for a file fitted before
                                                                    # kernel_memory_bytes existed
    python benchmarks/predict_validation.py --workdir $W report [--cluster-out clusters/local.toml]

1. calibrate: `mpiexec -n 2 mpihybrid train CALIBRATION --trace W/cal.h5` (the GPT benchmark,
   pp=2, 1F1B, M=4), then `mpihybrid predict ... --calibrate W/cal.h5 --cluster-out W/local.toml`.
2. cases: for every case, `mpiexec -n PP*DP mpihybrid bench train JOB --set ... --json` (median
   step of the measured steps) and `mpihybrid predict JOB --set ... --cluster W/local.toml --json`.
   Step-time error = predicted / measured - 1. Memory: the largest predicted rank total against
   the largest peak RSS `bench train` measured over the training steps (VmHWM, neither its
   evaluation nor its roofline pass); activations: the predicted per-stage peak against the
   runtime's own count. The calibration's own configuration is measured too (the sitting's
   spread) and left out of the error figures.
3. search: `mpihybrid predict jobs/gpt_bench.toml --search --world N` (N = 4: --ranks-per-node 4,
   the 4 ranks share this machine's cores), then `bench train` of the first pick and of the best
   layout of each of the next distinct pipelines (pp, dp, order, schedule, chunks, M) it ranked,
   --layouts of them in all: is the first pick within 5% of the best measured?

The machine drifts (+-10-20% minute to minute on 2 shared cores): the figures hold for one
sitting. Every run also says how many cores something else took meanwhile (other processes and
the hypervisor's steal: /proc/stat's busy time less the run's own CPU time); a run during which
that exceeded --quiet-below cores is run again, at most --retries times, and the table keeps
every try's step beside the kept one. The calibration is retried the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mpihybrid.launch import mpiexec_command

ROOT = Path(__file__).resolve().parent.parent
GPT, MLP = "jobs/gpt_bench.toml", "jobs/bench_pp2.toml"
VOCAB = "jobs/gpt_bench_vocab.toml"  # GPT-2's vocabulary: model.vocab_parallel on and off
CALIBRATION = (GPT, ["train.steps=20"])  # 19 measured steps: a few seconds of a shared machine


def _mlp(pp: int, dp: int, schedule: str, m: int, codec: str = "fp32", v: int = 1) -> tuple:
    # the MLP keeps 256-row micro-batches (as `mpihybrid sweep` does): the batch grows with M, dp
    sets = [f"grid.pp={pp}", f"grid.dp={dp}", f"train.schedule={schedule}",
            f"train.microbatches={m}", f"train.global_batch={256 * m * dp}", f"comm.codec={codec}",
            f"train.virtual_stages={v}"]  # fmt: skip
    return (MLP, sets)


def _gpt(pp: int, dp: int, schedule: str, m: int, codec: str = "fp32", v: int = 1) -> tuple:
    sets = [f"grid.pp={pp}", f"grid.dp={dp}", f"train.schedule={schedule}",
            f"train.microbatches={m}", f"train.global_batch={2 * m * dp}",
            f"comm.codec={codec}", f"train.virtual_stages={v}"]  # fmt: skip
    return (GPT, sets)


def _vocab(on: bool) -> tuple:
    sets = ["grid.pp=2", "grid.dp=1", "train.schedule=1f1b", "train.microbatches=4",
            "train.global_batch=8", "comm.codec=fp32", "train.virtual_stages=1",
            f"model.vocab_parallel={str(on).lower()}"]  # fmt: skip
    return (VOCAB, sets)


CASES = [
    _gpt(2, 1, "1f1b", 4),  # the calibration's configuration: the sitting's spread, not scored
    *(_mlp(2, 1, s, 4) for s in ("naive", "gpipe", "1f1b", "zb-h1")),
    _mlp(2, 1, "interleaved-1f1b", 4, v=2),
    _mlp(2, 1, "1f1b", 2),
    _mlp(2, 1, "1f1b", 8),
    _mlp(1, 1, "1f1b", 4),
    *(_mlp(1, 2, "1f1b", 4, c) for c in ("fp32", "fp16", "bf16", "int8")),
    _gpt(2, 1, "zb-h1", 4),
    _gpt(2, 1, "gpipe", 8),
    _gpt(2, 1, "interleaved-1f1b", 4, v=2),
    _gpt(2, 1, "naive", 2),
    _gpt(1, 1, "1f1b", 4),
    _gpt(1, 2, "1f1b", 2, "int8"),
    _gpt(1, 2, "1f1b", 2, "bf16"),
    _vocab(True),  # 20, 21: docs/vocab.md
    _vocab(False),
]


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
    from mpihybrid.trace.read import load
    from mpihybrid.trace.recorder import step_times

    job, sets = CALIBRATION
    trace, cluster = workdir / "cal.h5", workdir / "local.toml"
    attempts, others = 0, float("inf")
    while attempts <= retries and others > quiet:
        _, others = _run([*mpiexec_command(2, "mpihybrid"), "train", job, *_sets(sets),
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
        out, others = _run([*mpiexec_command(world, "mpihybrid"), "bench", "train", job,
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
    model = {GPT: "gpt", VOCAB: "gpt vocab 50257"}.get(row["job"], "mlp")
    if s.get("model.vocab_parallel") == "true":
        model += " vocab_parallel"
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


def _load(workdir: Path, name: str, default):
    path = workdir / name
    return json.loads(path.read_text()) if path.exists() else default


def _save(workdir: Path, name: str, data) -> None:
    (workdir / name).write_text(json.dumps(data, indent=1))


def _stamp() -> dict:
    return {"utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "load": os.getloadavg()[0]}  # fmt: skip


def phase_calibrate(args) -> None:
    cal = calibrate(args.workdir, args.quiet_below, args.retries)
    cal = {**{k: v for k, v in cal.items() if k != "cluster"}, **_stamp()}
    _save(args.workdir, "calibration.json", cal)
    print(f"calibrated: {args.workdir / 'local.toml'}; step {1e3 * cal['step_s']:.1f} ms, "
          f"other load {cal['other_load']:.2f} cores, {cal['attempts']} attempt(s)")  # fmt: skip


def phase_cases(args) -> None:
    lo, _, hi = args.only.partition(":")
    chosen = list(enumerate(CASES))[int(lo or 0) : int(hi) if hi else None]
    rows = {r["index"]: r for r in _load(args.workdir, "rows.json", [])}
    for i, case in chosen:
        row = measure_and_predict(case, args.workdir / "local.toml", args.warmup, args.steps,
                                  args.quiet_below, args.retries)  # fmt: skip
        rows[i] = {"index": i, **row, **_stamp()}
        print(f"[{i}] {_label(row)}: measured {1e3 * row['measured_step_s']:.1f} ms, predicted "
              f"{1e3 * row['predicted_step_s']:.1f} ms ({100 * row['step_error']:+.1f}%), "
              f"memory {100 * row['memory_error']:+.1f}%, other load {row['other_load']:.2f}",
              flush=True)  # fmt: skip
        _save(args.workdir, "rows.json", [rows[k] for k in sorted(rows)])


def _distinct(ranked: list[dict], count: int) -> list[dict]:
    """The first pick, then the best entry of each next distinct pipeline (all but codec and
    bucket), `count` in all."""
    chosen, seen = [ranked[0]], set()
    for e in ranked:
        key = tuple(x for x in e["set"] if not x.startswith("comm."))
        if key not in seen:
            seen.add(key)
            if e is not ranked[0]:
                chosen.append(e)
        if len(chosen) == count:
            break
    return chosen


def phase_search(args) -> None:
    job = "jobs/gpt_bench.toml"
    extra = ["--ranks-per-node", str(args.world)] if args.world > 2 else []
    out, _ = _run(["mpihybrid", "predict", job, "--search", "--world", str(args.world),
                   "--cluster", str(args.workdir / "local.toml"), "--json", *extra])  # fmt: skip
    ranked = json.loads(out)
    results = []
    for rank_of, entry in ((ranked.index(e), e) for e in _distinct(ranked, args.layouts)):
        tries = []
        while len(tries) <= args.retries and (not tries or tries[-1][1] > args.quiet_below):
            cmd = [*mpiexec_command(args.world, "mpihybrid"), "bench", "train", job,
                   *_sets(entry["set"]), "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--repeats", "1", "--json"]  # fmt: skip
            out, others = _run(cmd)
            tries.append((json.loads(out)["throughput"], others))
        results.append({"rank": rank_of + 1, "set": entry["set"], "reason": entry["reason"],
                        "predicted": entry["throughput"], "measured": tries[-1][0],
                        "other_load": tries[-1][1], "tries": tries, **_stamp()})  # fmt: skip
        print(f"#{rank_of + 1}: predicted {entry['throughput']:,.0f}, measured "
              f"{tries[-1][0]:,.0f} tokens/s (other load {tries[-1][1]:.2f}) "
              f"{' '.join(entry['set'])}", flush=True)  # fmt: skip
    searches = _load(args.workdir, "search.json", {})
    searches[str(args.world)] = {"layouts_ranked": len(ranked), "measured": results}
    _save(args.workdir, "search.json", searches)


def format_search(searches: dict) -> str:
    lines = []
    for world, s in sorted(searches.items()):
        m = s["measured"]
        best = max(m, key=lambda r: r["measured"])
        first = m[0]
        lines += [
            f"recommender, jobs/gpt_bench.toml on {world} ranks: {s['layouts_ranked']} layouts "
            f"ranked, {len(m)} measured",
            "| predicted rank | layout | tokens/s predicted | measured | other load |",
            "|---|---|---|---|---|",
        ]
        for r in m:
            layout = " ".join(x.split(".", 1)[1] for x in r["set"])
            lines.append(f"| {r['rank']} | {layout} | {r['predicted']:,.0f} | "
                         f"{r['measured']:,.0f} | {r['other_load']:.2f} |")  # fmt: skip
        lines += ["", f"first pick: {first['measured']:,.0f} tokens/s measured, best measured "
                      f"{best['measured']:,.0f} (predicted rank {best['rank']}): "
                      f"{100 * (first['measured'] / best['measured'] - 1):+.1f}%", ""]  # fmt: skip
    return "\n".join(lines)


def phase_report(args) -> None:
    rows = _load(args.workdir, "rows.json", [])
    cal = _load(args.workdir, "calibration.json", {})
    scored = [r for r in rows if r["index"] != 0]
    print(format_table(rows))
    print(summary(scored)["text"] + " (the calibration's configuration, row 0, not scored)")
    if cal:
        print(f"calibration at {cal['utc']} (load {cal['load']:.2f}): {cal['attempts']} "
              f"run(s), the kept one with {cal['other_load']:.2f} cores taken by something "
              "else")  # fmt: skip
        print(spread(rows, cal["step_s"]))
    if rows:
        print(f"cases measured {rows[0]['utc']} .. {rows[-1]['utc']}")
    searches = _load(args.workdir, "search.json", {})
    print(format_search(searches))
    if args.cluster_out:
        fitted = (args.workdir / "local.toml").read_text()
        keep_cluster(Path(args.cluster_out), fitted, cal.get("utc", "?"), (cal.get("load", 0), 0))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary(scored),
                                               "calibration": cal, "search": searches},
                                              indent=1))  # fmt: skip


def phase_memory(args) -> None:
    """The cases' memory predicted again with the sitting's cluster file refitted for the runtime's
    memory from the calibration trace and two fresh interpreters (kernel_memory_bytes): no
    timed figure is involved, so a cluster file fitted before that field existed catches up."""
    import dataclasses

    from mpihybrid.config import build_job, load_table, resolve
    from mpihybrid.predict.calibrate import _base_memory, trace_job
    from mpihybrid.predict.cluster import load_cluster
    from mpihybrid.predict.microbench import kernel_memory
    from mpihybrid.predict.model import predict
    from mpihybrid.trace.read import load

    cluster = load_cluster(args.workdir / "local.toml")
    trace = load(args.workdir / "cal.h5")
    device = dataclasses.replace(cluster.device, kernel_memory_bytes=kernel_memory())
    base, note = _base_memory(trace, trace_job(trace), dataclasses.replace(cluster, device=device))
    cluster = dataclasses.replace(
        cluster, device=dataclasses.replace(device, base_memory_bytes=base)
    )
    print(f"kernel_memory_bytes {device.kernel_memory_bytes / 2**20:.1f} MiB, base_memory_bytes "
          f"{base / 2**20:.1f} MiB ({note})")  # fmt: skip
    rows = _load(args.workdir, "rows.json", [])
    for r in rows:
        job = build_job(load_table(ROOT / r["job"]), r["sets"])
        predicted = predict(resolve(job, job.grid.pp * job.grid.dp), cluster)["peak_memory_bytes"]
        r["predicted_memory_bytes"] = predicted
        r["memory_error"] = predicted / r["measured_rss_bytes"] - 1
        measured = r["measured_rss_bytes"] / 2**20
        print(f"[{r['index']}] {_label(r)}: measured {measured:.0f} MiB, predicted "
              f"{predicted / 2**20:.0f} MiB ({100 * r['memory_error']:+.1f}%)")  # fmt: skip
    _save(args.workdir, "rows.json", rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="the sitting's files")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.3,
        metavar="CORES",
        help="a run during which something else took more cores is run again",
    )
    parser.add_argument("--retries", type=int, default=1, help="at most this many times")
    sub = parser.add_subparsers(dest="phase", required=True)
    sub.add_parser("calibrate")
    sub.add_parser("memory", help="refit the runtime's memory (no timing) and predict again")
    cases = sub.add_parser("cases")
    cases.add_argument("--only", default=":", metavar="A:B", help=f"cases A..B-1 of {len(CASES)}")
    search = sub.add_parser("search")
    search.add_argument("--world", type=int, default=2)
    search.add_argument("--layouts", type=int, default=8, help="distinct layouts measured")
    report = sub.add_parser("report")
    report.add_argument("--json", metavar="PATH", help="write every figure here")
    report.add_argument("--cluster-out", metavar="PATH", help="keep the fitted cluster file here")
    args = parser.parse_args()  # fmt: skip
    args.workdir.mkdir(parents=True, exist_ok=True)
    {"calibrate": phase_calibrate, "cases": phase_cases, "search": phase_search,
     "memory": phase_memory, "report": phase_report}[args.phase](args)  # fmt: skip


if __name__ == "__main__":
    main()
