"""whatif measured: the replay of each run itself, and predictions of a change against a real
run of that change (docs/analysis.md). Reads the traces benchmarks/replay_traces.sh wrote, one
folder per round; with several rounds a pair's predicted and measured steps are each the median
over the rounds (the machine's load drifts between runs), and the floor line says how far the
same unchanged job's runs differ between rounds (what no prediction from another run can beat):

    python benchmarks/whatif_pairs.py runs/r1 [runs/r2 runs/r3]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from mpihybrid.analysis.replay import Change, Measured, measured_figures, replay
from mpihybrid.predict.rows import costed
from mpihybrid.trace.read import load

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
        got = statistics.median(replay(b[src], costed(b[src], change))["step"] for b in have)
        want = statistics.median(measured_figures(b[real])["step"] for b in have)
        errs.append(abs(got / want - 1))
        print(f"  {src:14s} {change.text():24s} -> {real:14s} predicted {1e3 * got:8.2f} "
              f"measured {1e3 * want:8.2f} {got / want - 1:+.1%}")  # fmt: skip
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
    main(sys.argv[1:])
