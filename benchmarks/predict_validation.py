"""Calibrate `mpihybrid predict` on one local run, then predict other local runs and measure them
with `bench train` in the same sitting: the table of step-time and memory errors.

    OMP_NUM_THREADS=1 python benchmarks/predict_validation.py              # the full table
    OMP_NUM_THREADS=1 python benchmarks/predict_validation.py --quick      # 3 runs (the test's)
    python benchmarks/predict_validation.py --json runs/validation.json    # also every figure

1. `mpiexec -n 2 mpihybrid train CALIBRATION --trace DIR/cal.h5` (the GPT benchmark, pp=2,
   1F1B, M=4), then `mpihybrid predict ... --calibrate DIR/cal.h5 --cluster DIR/local.toml`.
2. For every case: `mpiexec -n PP*DP mpihybrid bench train JOB --set ... --json` (median step of
   the measured steps) and `mpihybrid predict JOB --set ... --cluster DIR/local.toml --json`.
Step-time error = predicted / measured - 1. Memory: the largest predicted rank total against the
largest peak RSS `bench train` measured; activations: the predicted per-stage peak against the
runtime's own count.

The machine drifts (+-20% minute to minute on 2 shared cores): the figures hold for one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT, MLP = "jobs/gpt_bench.toml", "jobs/bench_pp2.toml"
CALIBRATION = (GPT, ["train.steps=7"])


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


def _run(cmd: list[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return out.stdout


def _sets(sets: list[str]) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


def calibrate(workdir: Path) -> Path:
    job, sets = CALIBRATION
    trace, cluster = workdir / "cal.h5", workdir / "local.toml"
    _run(["mpiexec", "-n", "2", "mpihybrid", "train", job, *_sets(sets), "--quiet",
          "--trace", str(trace), "--overwrite"])  # fmt: skip
    _run(["mpihybrid", "predict", job, "--calibrate", str(trace), "--cluster", str(cluster)])
    return cluster


def measure_and_predict(case: tuple, cluster: Path, warmup: int, steps: int) -> dict:
    job, sets = case
    world = int(sets[0].split("=")[1]) * int(sets[1].split("=")[1])
    measured = json.loads(
        _run(["mpiexec", "-n", str(world), "mpihybrid", "bench", "train", job, *_sets(sets),
              "--warmup", str(warmup), "--steps", str(steps), "--repeats", "1", "--json"])
    )  # fmt: skip
    predicted = json.loads(
        _run(["mpihybrid", "predict", job, *_sets(sets), "--cluster", str(cluster), "--json"])
    )
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
        "| peak RSS MiB measured / predicted | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {_label(r)} | {1e3 * r['measured_step_s']:.1f} / {1e3 * r['predicted_step_s']:.1f}"
            f" | {100 * r['step_error']:+.0f}% | {r['measured_bubble']:.3f} / "
            f"{r['predicted_bubble']:.3f} | {r['measured_rss_bytes'] / 2**20:.0f} / "
            f"{r['predicted_memory_bytes'] / 2**20:.0f} | {100 * r['memory_error']:+.0f}% |"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the test's 3 runs")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    args = parser.parse_args()
    print(f"load average at the start (1, 5, 15 min): {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = calibrate(Path(tmp))
        rows = [
            measure_and_predict(case, cluster, args.warmup, args.steps)
            for case in (QUICK if args.quick else CASES)
        ]
        fitted = cluster.read_text()
    print(format_table(rows))
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "summary": summary(rows), "cluster": fitted}, indent=1)
        )


if __name__ == "__main__":
    main()
