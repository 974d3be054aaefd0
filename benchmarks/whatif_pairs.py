"""whatif measured: the replay of each run itself, and predictions of a change against a real
run of that change (docs/analysis.md). Reads the traces of rounds, one folder per round; with
several rounds a pair's predicted and measured steps are each the median over the rounds (the
machine's load drifts between runs), and the floor line says how far the same unchanged job's
runs differ between rounds (what no prediction from another run can beat):

    python benchmarks/whatif_pairs.py --write runs/r1 [STEPS]      # a round's traces (15 runs)
    python benchmarks/whatif_pairs.py runs/r1 [runs/r2 runs/r3]

--paired runs each pair's two jobs next to each other instead, A B B A for every repetition,
and predicts each run of the change from the run of the trace beside it: the machine's speed
drifts over minutes (benchmarks/core_speeds.py), so neighbours share it where rounds do not. Its
floor is the same job predicted from its own other run, three runs away:

    flock -x /tmp/mh_heavy.lock python benchmarks/whatif_pairs.py --paired runs/p1 --reps 2

Another --paired call on the same OUT adds its repetitions to those there (a sitting in pieces, so
the lock is held minutes at a time). --bind pins each rank to its own core (`-bind-to core`, the
launcher's own binding): two ranks that share a core for part of a run, or move between cores,
are the spread a run without it carries.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mpihybrid.analysis.replay import Change, Measured, measured_figures, replay
from mpihybrid.predict.rows import costed
from mpihybrid.trace.read import load

GPT, MLP = "mpihybrid/jobs/gpt_bench.toml", "mpihybrid/jobs/laptop.toml"
# the runs: name -> (job, settings); every built-in schedule at pp = 2 on the GPT benchmark job,
# the MLP laptop job at dp = 1, and the runs of the changes predicted
JOBS = {
    **{f"gpt_{s}": (GPT, [f"train.schedule={s}"])
       for s in ("naive", "gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "v-half")},
    "gpt_interleaved-1f1b": (GPT, ["train.schedule=interleaved-1f1b", "train.virtual_stages=2"]),
    "mlp_1f1b": (MLP, ["grid.dp=1"]),
    "mlp_gpipe": (MLP, ["grid.dp=1", "train.schedule=gpipe"]),
    "gpt_1f1b_m8": (GPT, ["train.microbatches=8"]),
    "gpt_gpipe_m8": (GPT, ["train.schedule=gpipe", "train.microbatches=8"]),
    "mlp_1f1b_m8": (MLP, ["grid.dp=1", "train.microbatches=8"]),
    "gpt_1f1b_slow": (GPT, ["train.slowdown=1:F:1.3"]),
}  # fmt: skip

# (trace replayed, the change, the trace of a run of that change)
PAIRS = [
    ("gpt_1f1b", Change(schedule="gpipe"), "gpt_gpipe"),
    ("gpt_1f1b", Change(schedule="naive"), "gpt_naive"),
    ("gpt_1f1b", Change(schedule="zb-h1"), "gpt_zb-h1"),
    ("gpt_1f1b", Change(schedule="zb-h2"), "gpt_zb-h2"),
    ("gpt_gpipe", Change(schedule="1f1b"), "gpt_1f1b"),
    ("gpt_zb-v", Change(schedule="dualpipev"), "gpt_dualpipev"),
    ("gpt_zb-v", Change(schedule="v-half"), "gpt_v-half"),
    ("gpt_1f1b", Change(microbatches=8), "gpt_1f1b_m8"),
    ("gpt_gpipe", Change(microbatches=8), "gpt_gpipe_m8"),
    ("mlp_1f1b", Change(schedule="gpipe"), "mlp_gpipe"),
    ("mlp_1f1b", Change(microbatches=8), "mlp_1f1b_m8"),
    ("gpt_1f1b_slow", Change(scales={("rank", 1, "F"): 1 / 1.3}), "gpt_1f1b"),
    # another placement: the trace's stage costs carried by the blocks' FLOPs (restage.py)
    ("gpt_1f1b", Change(schedule="zb-v"), "gpt_zb-v"),
    ("gpt_1f1b", Change(schedule="dualpipev"), "gpt_dualpipev"),
    ("gpt_1f1b", Change(schedule="interleaved-1f1b", virtual_stages=2), "gpt_interleaved-1f1b"),
    ("gpt_zb-v", Change(schedule="1f1b"), "gpt_1f1b"),
]


BIND: list[str] = []  # --bind: the launcher's arguments that pin each rank to a core


def train(name: str, out: Path, steps: int) -> Path:
    """One run of JOBS[name] on 2 ranks, traced to OUT/NAME.h5."""
    job, settings = JOBS[name]
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.h5"
    sets = [
        x for s in [f"train.steps={steps}", "trace.overwrite=true", *settings] for x in ("--set", s)
    ]
    cmd = [os.environ.get("MPIEXEC", "mpiexec"), "-n", "2", *BIND, sys.executable, "-m",
           "mpihybrid", "train", job, "--quiet", *sets, "--trace", str(path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    return path


def write(out: Path, steps: int) -> None:
    """A round: every job once, in JOBS's order."""
    for name in JOBS:
        print(train(name, out, steps), flush=True)


def paired(out: Path, reps: int, steps: int, only: list[int]) -> None:
    """Each pair's trace and change run A B B A per repetition, under OUT/pairNN/repR, after
    the repetitions already there."""
    for i in only:
        src, _, real = PAIRS[i]
        done = len(list((out / f"pair{i:02d}").glob("rep*")))
        for r in range(done, done + reps):
            d = out / f"pair{i:02d}" / f"rep{r}"
            for k, name in (("a1", src), ("b1", real), ("b2", real), ("a2", src)):
                train(name, d / k, steps)
    paired_report(out)


def paired_report(out: Path) -> None:
    """Each run of the change predicted from the run of the trace beside it; the floor: each
    run of the trace predicted from the other (the same job, three runs away)."""
    errs, floor = [], []
    print("whatif against the run of the change beside it (mean step, ms; median over the reps)")
    for i, (src, change, real) in enumerate(PAIRS):
        got, want, same = [], [], []
        for d in sorted((out / f"pair{i:02d}").glob("rep*")):
            m = {k: Measured.of(load(p), str(p)) for k in ("a1", "b1", "b2", "a2")
                 for p in [d / k / f"{src if k[0] == 'a' else real}.h5"]}  # fmt: skip
            for a, b in (("a1", "b1"), ("a2", "b2")):
                got.append(replay(m[a], costed(m[a], change))["step"])
                want.append(measured_figures(m[b])["step"])
            for a, b in (("a1", "a2"), ("a2", "a1")):
                same.append(
                    abs(replay(m[a], Change())["step"] / measured_figures(m[b])["step"] - 1)
                )
        if not got:
            continue
        each = [g / w - 1 for g, w in zip(got, want, strict=True)]
        ratio = statistics.median(each)
        errs.append(abs(ratio))
        floor.append(statistics.median(same))
        print(
            f"  {src:14s} {change.text():24s} -> {real:14s} predicted "
            f"{1e3 * statistics.median(got):8.2f} measured {1e3 * statistics.median(want):8.2f} "
            f"{ratio:+.1%}  (each: {' '.join(f'{e:+.1%}' for e in each)}; the trace's own "
            f"job: {statistics.median(same):.1%})",
            flush=True,
        )
    print(f"  median {statistics.median(errs):.1%}, worst {max(errs):.1%} over {len(errs)} pairs")
    print(
        f"the floor: each pair's trace predicting its own other run: median "
        f"{statistics.median(floor):.1%}, worst {max(floor):.1%} over {len(floor)} pairs"
    )


def main(folders: list[str]) -> None:
    rounds = [
        {p.stem: Measured.of(load(p), str(p)) for p in sorted(Path(f).glob("*.h5"))}
        for f in folders
    ]
    own = []
    for base in rounds:
        own += _own(base)
    print(f"  median {statistics.median(own):.1%}, worst {max(own):.1%} over {len(own)} traces")
    errs = []
    print("whatif against a run of the change (mean step, ms; median over the rounds)")
    for src, change, real in PAIRS:
        have = [b for b in rounds if src in b and real in b]
        if not have:
            continue
        gots = [replay(b[src], costed(b[src], change))["step"] for b in have]
        wants = [measured_figures(b[real])["step"] for b in have]
        got, want = statistics.median(gots), statistics.median(wants)
        errs.append(abs(got / want - 1))
        each = " ".join(f"{g / w - 1:+.1%}" for g, w in zip(gots, wants, strict=True))
        print(f"  {src:14s} {change.text():24s} -> {real:14s} predicted {1e3 * got:8.2f} "
              f"measured {1e3 * want:8.2f} {got / want - 1:+.1%} (rounds: {each})")  # fmt: skip
    if errs:
        worst = max(errs)
        print(f"  median {statistics.median(errs):.1%}, worst {worst:.1%} over {len(errs)} pairs")
    _floor(rounds)


def _floor(rounds: list[dict]) -> None:
    """The machine's floor under those errors: the same job, unchanged, predicted from half the
    rounds (the median of their replays) and measured in the other half (the median of their
    steps); no change to predict, so every error is the run-to-run spread that the pairs above
    carry too. With 2 or 3 rounds, single runs of one round against another."""
    if len(rounds) < 2:
        return
    halves = [(rounds[0::2], rounds[1::2]), (rounds[1::2], rounds[0::2])]
    if len(rounds) < 4:
        halves = [([a], [b]) for i, a in enumerate(rounds) for b in rounds[i + 1 :]]
    errs = []
    for one, other in halves:
        for name in sorted(set.intersection(*(set(r) for r in rounds))):
            got = statistics.median(replay(r[name], Change())["step"] for r in one)
            want = statistics.median(measured_figures(r[name])["step"] for r in other)
            errs.append(abs(got / want - 1))
    how = "halves of the rounds" if len(rounds) >= 4 else "one round against another"
    print(
        f"the floor: the same job replayed and measured in other runs ({how}): median "
        f"{statistics.median(errs):.1%}, worst {max(errs):.1%} over {len(errs)} pairs"
    )


def _own(base: dict) -> list[float]:
    own = []
    print("replay of the run itself (mean step, ms)")
    for name, b in base.items():
        got, want = replay(b, Change())["step"], measured_figures(b)["step"]
        own.append(abs(got / want - 1))
        change = f"{got / want - 1:+.1%}"
        print(f"  {name:22s} measured {1e3 * want:8.2f} replayed {1e3 * got:8.2f} {change}")
    return own


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*")
    parser.add_argument("--write", metavar="OUT", help="write a round's traces to OUT")
    parser.add_argument("--paired", metavar="OUT", help="run each pair A B B A under OUT")
    parser.add_argument("--reps", type=int, default=2, help="0: report OUT's runs again")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", help="the pairs to run, by index (0,3,14)")
    parser.add_argument("--bind", action="store_true", help="pin each rank to its own core")
    args = parser.parse_args()
    only = [int(i) for i in args.only.split(",")] if args.only else list(range(len(PAIRS)))
    if args.bind:
        BIND[:] = ["-bind-to", "core"]
    if args.write:
        write(Path(args.write), int(args.folders[0]) if args.folders else args.steps)
    elif args.paired and args.reps:
        paired(Path(args.paired), args.reps, args.steps, only)
    elif args.paired:
        paired_report(Path(args.paired))
    else:
        main(args.folders)
