"""The GPT table of docs/performance.md in one sitting: mpihybrid's runs of jobs/gpt_bench.toml
beside the same workload on torch.distributed.pipelining, round after round, so that every ratio
pairs runs made minutes apart under the same load.

    flock -x /tmp/mh_heavy.lock python benchmarks/gpt_sitting.py --rounds 3 \\
        --kernels off,Haswell                # OpenBLAS's own pick against the Haswell kernels

Each round runs, in this order: each of torch's schedules named by --torch
(`benchmarks/torch_pipelining.py --schedule S`; default 1F1B, its Interleaved 1F1B, ZBV and
DualPipeV, the last three with two stages a rank), then for each kernel set
(MPIHYBRID_BLAS, mpihybrid/_blas.py: `off` = OpenBLAS's own pick, a
name = that set, `cache` = what `mpihybrid bench blas --save` chose) every mpihybrid run:
`mpiexec -n 2 mpihybrid bench train jobs/gpt_bench.toml --json --repeats 1` with zb-v, dualpipev,
1F1B and at pp=1 x dp=2 (without and with train.shard_optimizer: fp32 ZeRO-1 has the same bits;
--pp2 leaves these two out).
A run's roofline is measured right after it, with its own kernels. Printed: per run the median
over rounds of tokens/s and of roofline fraction with their ranges, and the ratios paired within
each round: against torch's 1F1B, against torch's best schedule of that round, against 1F1B
(same kernels) and kernel set against the first. Needs
torch (CPU) for the torch column; never runs in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "jobs" / "gpt_bench.toml")
RUNS = {  # name -> bench train overrides
    "zb-v, pp=2": ["train.schedule=zb-v"],
    "dualpipev, pp=2": ["train.schedule=dualpipev"],
    "1f1b, pp=2": ["train.schedule=1f1b"],
    "pp=1 x dp=2": ["grid.pp=1", "grid.dp=2"],
    "pp=1 x dp=2, ZeRO-1": ["grid.pp=1", "grid.dp=2", "train.shard_optimizer=true"],
}


def _env(kernels: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("MPIHYBRID_BLAS", None)
    if kernels != "cache":
        env["MPIHYBRID_BLAS"] = kernels
    return env


def torch_run(schedule: str, steps: int) -> float:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "torch_pipelining.py"), "--schedule", schedule,
         "--repeats", "1", "--steps", str(steps)],
        capture_output=True, text=True, check=True, env=_env("off"),
    ).stdout  # fmt: skip
    return float(re.search(r": ([\d,]+) tokens/s", out).group(1).replace(",", ""))


def bench_run(sets: list[str], kernels: str, steps: int) -> dict:
    from mpihybrid.launch import mpiexec_command

    cmd = [*mpiexec_command(2, sys.executable), "-m", "mpihybrid", "bench", "train", JOB,
           "--json", "--quiet", "--repeats", "1", "--steps", str(steps)]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env(kernels))
    r = json.loads(out.stdout)
    return {"tokens": r["throughput"], "roofline": r["roofline_fraction"], "blas": r["blas"]}


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}" \
           f"..{format(max(values), fmt)})"  # fmt: skip


def _ratio(these: list[float], those: list[float], fmt: str) -> str:
    """Round by round this / that: the median and range."""
    return _spread([a / b for a, b in zip(these, those, strict=True)], fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run")
    parser.add_argument("--kernels", default="cache", help="comma list: off, cache or a name")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--torch",
        default="1f1b,interleaved,zbv,dualpipev",
        help="torch's schedules to run (torch_pipelining.py's names)",
    )
    parser.add_argument("--pp2", action="store_true", help="only the pp=2 runs")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    kernel_sets = args.kernels.split(",")
    seen: dict[tuple[str, str], list[dict]] = {}
    chosen = {n: v for n, v in RUNS.items() if "pp=2" in n or not args.pp2}
    torch_names = [] if args.no_torch else args.torch.split(",")
    by_torch: dict[str, list[float]] = {n: [] for n in torch_names}
    for r in range(args.rounds):
        for name in torch_names:
            by_torch[name].append(torch_run(name, args.steps))
        for k in kernel_sets:
            for name, sets in chosen.items():
                seen.setdefault((k, name), []).append(bench_run(sets, k, args.steps))
        print(f"[{r + 1}/{args.rounds}] round done", file=sys.stderr, flush=True)

    torch = by_torch.get("1f1b", [])
    best = [max(rates) for rates in zip(*by_torch.values(), strict=True)] if torch_names else []
    lines = ["| kernels | run | tokens/s | of roofline | vs torch 1F1B | vs torch's best | vs 1F1B "
             f"| vs {kernel_sets[0]} |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for k in kernel_sets:
        for name in chosen:
            runs = seen[k, name]
            tokens = [x["tokens"] for x in runs]
            base = [x["tokens"] for x in seen[k, "1f1b, pp=2"]]
            first = [x["tokens"] for x in seen[kernel_sets[0], name]]
            vs_torch = _ratio(tokens, torch, ".2f") if torch else "-"
            vs_best = _ratio(tokens, best, ".2f") if best else "-"
            vs_1f1b = (
                _ratio(tokens, base, ".3f") if name != "1f1b, pp=2" and "pp=2" in name else "-"
            )
            vs_k = _ratio(tokens, first, ".3f") if k != kernel_sets[0] else "-"
            lines.append(
                f"| {runs[0]['blas'].split(' (')[0]} | {name} | {_spread(tokens, ',.0f')} | "
                f"{_spread([100 * x['roofline'] for x in runs], '.1f')} % | {vs_torch} | "
                f"{vs_best} | {vs_1f1b} | {vs_k} |"
            )
    for name, rates in by_torch.items():
        lines.append(f"\ntorch.distributed.pipelining {name}: {_spread(rates, ',.0f')} tokens/s")
    print(f"{args.rounds} rounds, {args.steps} measured steps per run; median (min..max), "
          "ratios paired within a round")  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    main()
