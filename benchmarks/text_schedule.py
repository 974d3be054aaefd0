"""The text job with nanoGPT's recipe (warmup, cosine decay, clipping) against its constant rate:
held-out loss at every evaluation and at the end, for three seeds, and whether each run leaves
the early plateau.

    mpihybrid data prepare "$STDLIB" --glob '*.py' --exclude site-packages --exclude test \\
        -o data/stdlib
    nice -n 19 python benchmarks/text_schedule.py --out runs/text_schedule

Every run is `mpiexec -n 2 mpihybrid train jobs/text_gpt.toml` (pp = 2, 1F1B, AdamW, 1200
steps) with data.seed = train.seed = the seed and the held-out loss every 100 steps; a recipe
only adds its --set lines:

    constant-1.5e-3   the job as it is (train.lr = 1.5e-3, constant)
    constant-3e-3     the job at train.lr = 3e-3
    recipe-1.5e-3     + warmup 100 steps, cosine to lr / 10 at step 1200, grad_clip 1.0
    recipe-3e-3       the same at train.lr = 3e-3

Each run's evaluations (and its gradient norms) go to OUT/<recipe>-seed<S>.json; runs already
there are not run again (--max-minutes cuts the work into sittings). The table is made from
whatever runs exist. The figures are losses, not times: run it at low priority, without a lock.
A run "leaves the plateau" at the first evaluation whose held-out loss is
below PLATEAU nats (the runs that stay on it sit at 2.9-3.0 at step 100, docs/memory.md; the
ones that leave are at 2.52-2.59).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PLATEAU = 2.6  # nats: below it, the run has left the early plateau
GOAL = 1.70  # nats: the goal, below the constant-rate job's 1.71 (docs/text.md)
RECIPE = ["train.lr_schedule=cosine", "train.warmup_steps=100", "train.grad_clip=1.0"]
RECIPES = {
    "constant-1.5e-3": [],
    "constant-3e-3": ["train.lr=0.003"],
    "recipe-1.5e-3": [*RECIPE, "train.lr=0.0015", "train.min_lr=0.00015"],
    "recipe-3e-3": [*RECIPE, "train.lr=0.003", "train.min_lr=0.0003"],
}
BASE = ['checkpoint.dir=""', "checkpoint.every=0", "train.eval_every=100", "train.log_every=0"]


def run_one(recipe: str, seed: int, out: Path, data: Path) -> dict:
    from mpihybrid.trace.read import load
    from tests.helpers import mpiexec

    trace = out / f"{recipe}-seed{seed}.h5"
    sets = [*BASE, f"data.seed={seed}", f"train.seed={seed}", f'data.train="{data}/train.bin"',
            f'data.val="{data}/val.bin"', *RECIPES[recipe]]  # fmt: skip
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpihybrid", "train",
           "jobs/text_gpt.toml", "--quiet", "--overwrite", "--trace", str(trace)]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{recipe} seed={seed} failed:\n{proc.stderr}")
    t = load(trace)
    trace.unlink()
    norms = t.steps.get("grad_norm")
    return {
        "recipe": recipe, "seed": seed, "eval_step": (t.evals["step"] + 1).tolist(),
        "val_loss": t.evals["loss"].tolist(), "seconds": time.monotonic() - t0,
        "grad_norm": None if norms is None else np.asarray(norms).tolist(),
    }  # fmt: skip


def left_at(run: dict) -> int | None:
    """The first evaluation's step below PLATEAU nats (None: never)."""
    return next((s for s, v in zip(run["eval_step"], run["val_loss"], strict=True)
                 if v < PLATEAU), None)  # fmt: skip


def table(runs: list[dict]) -> str:
    by = {(r["recipe"], r["seed"]): r for r in runs}
    steps = next(iter(runs))["eval_step"] if runs else []
    lines = [
        "| recipe | seed | " + " | ".join(str(s) for s in steps) + " | left plateau at |",
        "|---|---|" + "---|" * len(steps) + "---|",
    ]
    summary = []
    for recipe in RECIPES:
        seeds = sorted(s for r, s in by if r == recipe)
        for s in seeds:
            r = by[recipe, s]
            cells = " | ".join(f"{v:.3f}" for v in r["val_loss"])
            lines.append(f"| {recipe} | {s} | {cells} | {left_at(r) or 'never'} |")
        if seeds:
            final = [by[recipe, s]["val_loss"][-1] for s in seeds]
            sd = statistics.stdev(final) if len(final) > 1 else 0.0
            left = sum(left_at(by[recipe, s]) is not None for s in seeds)
            below = sum(v < GOAL for v in final)
            summary.append(
                f"{recipe}: final {np.mean(final):.4f} ± {sd:.4f} nats "
                f"({', '.join(f'{v:.4f}' for v in final)}); {left}/{len(seeds)} leave the "
                f"plateau; {below}/{len(seeds)} end below {GOAL}"
            )
    return "\n".join(lines + [""] + summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/text_schedule")
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--max-minutes", type=float, default=0.0, help="0 = no limit")
    args = parser.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    recipes = args.recipes.split(",")
    if unknown := [r for r in recipes if r not in RECIPES]:
        raise SystemExit(f"unknown recipe {unknown[0]!r}: choose from {', '.join(RECIPES)}")
    start = time.monotonic()
    for seed in (int(s) for s in args.seeds.split(",")):
        for recipe in recipes:
            path = out / f"{recipe}-seed{seed}.json"
            if path.exists():
                continue
            if args.max_minutes and time.monotonic() - start > 60 * args.max_minutes:
                print("time is up: run again to go on", file=sys.stderr)
                break
            run = run_one(recipe, seed, out, (ROOT / args.data).resolve())
            path.write_text(json.dumps(run))
            print(f"{recipe} seed {seed}: {run['val_loss'][-1]:.4f} nats "
                  f"({run['seconds']:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    print(table(runs))


if __name__ == "__main__":
    main()
