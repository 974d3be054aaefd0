"""Codec convergence on real text: the same job trained with every gradient codec (or weight-gather
codec), at several dp, with several seeds; held-out loss against step (mean and spread) and a table.

    mpihybrid data prepare "$STDLIB" --glob '*.py' --exclude site-packages --exclude test \\
        -o data/stdlib
    python benchmarks/codec_convergence.py --out runs/codec_convergence \\
        --plot docs/codec_convergence.png [--max-minutes 4]

    python benchmarks/codec_convergence.py --codecs fp32,gather-bf16,gather-int8 --dp 2 \\
        --out runs/gather_convergence [--job-settings --steps 1200 --eval-every 100]

    python benchmarks/codec_convergence.py --codecs fp32,wire-bf16,wire-int8 --pp 2 --dp 1 \\
        --job-settings --steps 1200 --eval-every 100 --out runs/wire_convergence

Every run is `mpiexec -n PP*DP mpihybrid train JOB` with only comm.codec / comm.error_feedback
changing between gradient codecs; a `gather-*` codec is the distributed optimizer
(train.shard_optimizer) whose weight all-gather sends comm.param_codec, over an fp32 gradient
ring (gather-fp32 has fp32's bits: the reference of both kinds is fp32); a `wire-*` codec is
comm.p2p_codec on every pipeline link (--pp 2 or more; wire-fp32 has fp32's bits). The runs
train the benchmark's small model (SMALL), or with --job-settings the job's own model and
training, on --pp stages (1 by default). data.seed and train.seed are the seed (the same
windows, the same initial weights for every codec), so the codec is the only difference. Each
run's held-out losses (the trace's /eval) go to OUT/<codec>[-pp<P>]-dp<D>-seed<S>.json; runs
already there are not run again, so --max-minutes cuts the work into sittings (a lock held by
the caller, or per run with --lock). The table and the plot are made from whatever runs exist.
Losses do not depend on the machine's load (same job + seed = same losses, bit for bit); only
the wall time of a run suffers from company.
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

# name -> the overrides that make it; int8-noef is int8 without the error-feedback residual
GRADIENT_CODECS = {
    "fp32": ["comm.codec=fp32"],
    "bf16": ["comm.codec=bf16"],
    "fp16": ["comm.codec=fp16"],
    "int8": ["comm.codec=int8", "comm.error_feedback=true"],
    "int8-noef": ["comm.codec=int8", "comm.error_feedback=false"],
}
# ZeRO-1 (train.shard_optimizer) with the weight all-gather in comm.param_codec, fp32 gradients
GATHER_CODECS = {
    f"gather-{name}": ["comm.codec=fp32", "train.shard_optimizer=true", f"comm.param_codec={name}"]
    for name in ("fp32", "bf16", "int8")
}
# the pipeline wire (comm.p2p_codec) on every link, so it applies on one node: the activations
# and activation gradients a stage sends; run at --pp 2 or more (wire-fp32 has fp32's bits)
WIRE_CODECS = {
    f"wire-{name}": ["comm.codec=fp32", f"comm.p2p_codec={name}", "comm.p2p_codec_scope=all"]
    for name in ("fp32", "fp16", "bf16", "int8")
}
CODECS = {**GRADIENT_CODECS, **GATHER_CODECS, **WIRE_CODECS}
# the benchmark's model: small enough that 30 runs fit a sitting or two on 2 cores
SMALL = ["model.hidden=64", "model.depth=2", "model.heads=4", "train.lr=0.0015",
         "train.global_batch=32", "train.microbatches=2", "data.test_samples=64",
         'checkpoint.dir=""', "checkpoint.every=0"]  # fmt: skip
# --job-settings: the job's own model and training (on --pp stages), writing no checkpoint
JOB_SETTINGS = ['checkpoint.dir=""', "checkpoint.every=0"]


def run_name(codec: str, pp: int, dp: int, seed: int) -> str:
    """A run's file stem; pp = 1 keeps the names runs made before --pp had."""
    return f"{codec}-{f'pp{pp}-' if pp > 1 else ''}dp{dp}-seed{seed}"


def run_one(job: str, data: Path, codec: str, dp: int, seed: int, steps: int, every: int,
            out: Path, lock: str = "", extra: tuple = (), base: tuple = tuple(SMALL),
            pp: int = 1) -> dict:  # fmt: skip
    from mpihybrid.launch import mpiexec_command
    from mpihybrid.trace.read import load

    trace = out / f"{run_name(codec, pp, dp, seed)}.h5"
    sets = [*base, f"grid.pp={pp}", f"grid.dp={dp}", f"data.seed={seed}", f"train.seed={seed}",
            f"train.steps={steps}", f"train.eval_every={every}",
            f'data.train="{data}/train.bin"', f'data.val="{data}/val.bin"',
            *CODECS[codec], *extra]  # fmt: skip
    cmd = [*mpiexec_command(pp * dp, sys.executable), "-m", "mpihybrid", "train", job,
           "--quiet", "--overwrite", "--trace", str(trace)]  # fmt: skip
    if lock:  # held for this run only: others' runs get their turn between two of ours
        cmd = ["flock", "-s" if lock.startswith("shared:") else "-x", lock.split(":")[-1], *cmd]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{codec} dp={dp} seed={seed} failed:\n{proc.stderr}")
    evals = load(trace).evals
    trace.unlink()
    return {
        "codec": codec, "pp": pp, "dp": dp, "seed": seed, "steps": steps,
        "eval_step": (evals["step"] + 1).tolist(), "val_loss": evals["loss"].tolist(),
        "seconds": time.monotonic() - t0,
    }  # fmt: skip


def load_runs(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def table(runs: list[dict], codecs: list[str], dps: list[int]) -> str:
    """Final held-out loss by codec and dp over seeds; its change from fp32, paired by seed."""
    final = {(r["codec"], r["dp"], r["seed"]): r["val_loss"][-1] for r in runs}
    lines = [
        "| codec | dp | seeds | final val loss (nats), mean ± sd | vs fp32, paired by seed |",
        "|---|---|---|---|---|",
    ]
    for dp in dps:
        for codec in codecs:
            seeds = sorted(s for c, d, s in final if (c, d) == (codec, dp))
            if not seeds:
                continue
            values = [final[codec, dp, s] for s in seeds]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            rel = [final[codec, dp, s] / final["fp32", dp, s] - 1 for s in seeds
                   if ("fp32", dp, s) in final]  # fmt: skip
            vs = (f"{100 * np.mean(rel):+.2f} % (seeds {min(rel) * 100:+.2f} .. "
                  f"{max(rel) * 100:+.2f} %)") if rel else "-"  # fmt: skip
            lines.append(
                f"| {codec} | {dp} | {len(seeds)} | {np.mean(values):.4f} ± {sd:.4f} | {vs} |"
            )
    # the same fp32 training at another dp differs only in float summation order: how far two
    # runs drift apart from that alone is the floor under which a codec's change means nothing
    for dp in dps[1:]:
        seeds = sorted(s for c, d, s in final if (c, d) == ("fp32", dp))
        rel = [
            100 * (final["fp32", dp, s] / final["fp32", dps[0], s] - 1)
            for s in seeds
            if ("fp32", dps[0], s) in final
        ]
        if rel:
            lines.append(
                f"\nfloor: fp32 at dp={dp} vs fp32 at dp={dps[0]}, same seeds (summation order "
                f"only): {', '.join(f'{r:+.2f} %' for r in rel)}"
            )
    return "\n".join(lines)


def plot(runs: list[dict], codecs: list[str], dps: list[int], path: str, entropy: float) -> None:
    """Top: held-out loss against step, the mean over seeds and its min..max band; bottom: the
    change from fp32's loss of the same seed (%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mpihybrid.files import atomic_path

    fig, axes = plt.subplots(2, len(dps), figsize=(6 * len(dps), 8), squeeze=False)
    colours = dict(zip(codecs, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for col, dp in enumerate(dps):
        base = {r["seed"]: np.array(r["val_loss"]) for r in runs
                if r["dp"] == dp and r["codec"] == "fp32"}  # fmt: skip
        top, bottom = axes[0, col], axes[1, col]
        for codec in codecs:
            mine = [r for r in runs if r["dp"] == dp and r["codec"] == codec]
            if not mine:
                continue
            steps = np.array(mine[0]["eval_step"])
            loss = np.array([r["val_loss"] for r in mine])
            c = colours[codec]
            top.plot(steps, loss.mean(0), color=c, label=f"{codec} ({len(mine)} seeds)")
            top.fill_between(steps, loss.min(0), loss.max(0), color=c, alpha=0.2)
            paired = [100 * (np.array(r["val_loss"]) / base[r["seed"]] - 1)
                      for r in mine if r["seed"] in base]  # fmt: skip
            if paired:
                rel = np.array(paired)
                bottom.plot(steps, rel.mean(0), color=c, label=codec)
                bottom.fill_between(steps, rel.min(0), rel.max(0), color=c, alpha=0.2)
        if entropy:
            top.axhline(entropy, color="grey", ls=":", label="unigram entropy of train")
        top.set(title=f"dp = {dp}: held-out loss", xlabel="step", ylabel="nats / token")
        top.legend(fontsize=8)
        bottom.axhline(0, color="grey", lw=0.5)
        for y in (-1, 1):
            bottom.axhline(y, color="grey", ls="--", lw=0.5)
        bottom.set(title=f"dp = {dp}: change from fp32 (same seed)", xlabel="step", ylabel="%")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path, overwrite=True) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)


def unigram_entropy(data: Path) -> float:
    from mpihybrid.nn.tokens import open_tokens

    counts = np.bincount(np.asarray(open_tokens(data / "train.bin")), minlength=65536)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="jobs/text_gpt.toml")
    parser.add_argument("--data", default="data/stdlib", help="a `data prepare` directory")
    parser.add_argument("--codecs", default=",".join(GRADIENT_CODECS),
                        help=f"comma-separated, of {', '.join(CODECS)}")  # fmt: skip
    parser.add_argument("--dp", default="2,4")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages of every run")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed", type=int, action="append", default=[],
                        help="run only this seed (repeatable; sittings side by side)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", default="runs/codec_convergence")
    parser.add_argument("--plot", default="", help="PNG to write (needs matplotlib)")
    parser.add_argument("--max-minutes", type=float, default=0, help="start no run after this")
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        help="one more job override for every run (repeatable)")  # fmt: skip
    parser.add_argument("--job-settings", action="store_true",
                        help="the job's own model and training, not the small model")  # fmt: skip
    parser.add_argument(
        "--lock", default="", metavar="[shared:]PATH", help="a flock held around every run"
    )
    args = parser.parse_args()
    codecs, dps = args.codecs.split(","), [int(d) for d in args.dp.split(",")]
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        print(f"--codecs: unknown {', '.join(unknown)}; choose from {', '.join(CODECS)}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    base = tuple(JOB_SETTINGS if args.job_settings else SMALL)
    out, data = Path(args.out), Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # seed-major: a sitting cut short still leaves whole comparisons (every codec, one seed)
    seeds = args.seed or range(args.seeds)
    todo = [(s, dp, c) for s in seeds for dp in dps for c in codecs]
    for seed, dp, codec in todo:
        path = out / f"{run_name(codec, args.pp, dp, seed)}.json"
        if path.exists():
            continue
        if args.max_minutes and time.monotonic() - t0 > 60 * args.max_minutes:
            print(f"stopped after {args.max_minutes} minutes; run again to go on")
            break
        r = run_one(args.job, data, codec, dp, seed, args.steps, args.eval_every, out, args.lock,
                    tuple(args.extra), base, args.pp)  # fmt: skip
        path.write_text(json.dumps(r))
        print(f"{codec:9s} pp={args.pp} dp={dp} seed={seed}: final val loss "
              f"{r['val_loss'][-1]:.4f} ({r['seconds']:.0f} s)", flush=True)  # fmt: skip
    runs = [r for r in load_runs(out)
            if r["codec"] in codecs and r["dp"] in dps and r.get("pp", 1) == args.pp]  # fmt: skip
    print(table(runs, codecs, dps))
    if args.plot and runs:
        plot(runs, codecs, dps, args.plot, unigram_entropy(data))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
