"""The schedule table and plot of docs/schedules.md, from `mpihybrid sweep` CSVs (one M each).

    python benchmarks/schedules_table.py runs/sweep_gpt_bench_pp2.csv \
        runs/sweep_gpt_bench_pp4_1.csv,runs/sweep_gpt_bench_pp4_2.csv \
        --plot docs/schedules_gpt_bench.png

A comma-joined list of CSVs is one sweep taken in several launches (their rows are repeats).

Prints one Markdown table per CSV: per schedule the median over repeats of tokens/s (with the
range), the step, the bubble measured / simulated / by formula, the measured bubble against the
simulated one in every repeat, F / B / W and the rank peak against the action lists and the
paper's column. --plot draws, per CSV, the throughput and the three bubbles side by side.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
from pathlib import Path


def read(paths: str) -> dict[str, list[dict]]:
    """Rows of one or more (comma-joined) sweep CSVs by schedule, in file order."""
    by_schedule: dict[str, list[dict]] = {}
    for path in paths.split(","):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                by_schedule.setdefault(row["schedule"], []).append(row)
    return by_schedule


def median(rows: list[dict], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def table(by_schedule: dict[str, list[dict]]) -> str:
    first = next(iter(by_schedule.values()))[0]
    rate = "tokens_per_s" if first["tokens_per_s"] else "samples_per_s"
    lines = [
        f"| schedule | v | {rate.split('_')[0]}/s median (min-max) | step ms | bubble measured / "
        "simulated / formula | measured vs simulated, each repeat | F / B / W ms | rank peak "
        "measured / predicted | paper |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in by_schedule.items():
        rates = [float(r[rate]) for r in rows]
        apart = ", ".join(
            f"{float(r['bubble_measured']) / float(r['bubble_predicted']) - 1:+.0%}" for r in rows
        )
        lines.append(
            f"| {name} | {rows[0]['virtual_stages']} | {statistics.median(rates):,.0f} "
            f"({min(rates):,.0f}-{max(rates):,.0f}) | {median(rows, 'step_ms'):.0f} | "
            f"{median(rows, 'bubble_measured'):.3f} / {median(rows, 'bubble_predicted'):.3f} / "
            f"{float(rows[0]['bubble_textbook']):.3f} | {apart} | "
            f"{median(rows, 'forward_ms'):.1f} / {median(rows, 'backward_ms'):.1f} / "
            f"{median(rows, 'weight_ms'):.1f} | {float(rows[-1]['peak_rank']):g} / "
            f"{float(rows[0]['peak_rank_predicted']):g} | {rows[0]['memory_paper']} |"
        )
    return "\n".join(lines)


def plot(sweeps: list[tuple[Path, dict[str, list[dict]]]], out: Path, cores: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sweeps), 2, figsize=(11, 3.6 * len(sweeps)), squeeze=False)
    for (path, by_schedule), (ax_rate, ax_bubble) in zip(sweeps, axes, strict=True):
        first = next(iter(by_schedule.values()))[0]
        rate = "tokens_per_s" if first["tokens_per_s"] else "samples_per_s"
        names = list(by_schedule)
        x = range(len(names))
        rates = [[float(r[rate]) for r in by_schedule[n]] for n in names]
        mid = [statistics.median(r) for r in rates]
        ax_rate.bar(x, mid, color="#4c72b0")
        ax_rate.errorbar(
            x, mid, yerr=[[m - min(r) for m, r in zip(mid, rates, strict=True)],
                          [max(r) - m for m, r in zip(mid, rates, strict=True)]],
            fmt="none", color="black", capsize=3,
        )  # fmt: skip
        ax_rate.set_ylabel(rate.replace("_per_s", " / s"))
        repeats = len(rates[0])
        width = 0.27
        series = (
            ("bubble_measured", "measured (median)", "#dd8452"),
            ("bubble_predicted", "simulated from the run's costs (median)", "#55a868"),
            ("bubble_textbook", "formula (F = B = W)", "#8c8c8c"),
        )
        for i, (key, label, colour) in enumerate(series):
            values = [median(by_schedule[n], key) for n in names]
            ax_bubble.bar([j + (i - 1) * width for j in x], values, width, label=label,
                          color=colour)  # fmt: skip
        ax_bubble.set_ylabel("bubble (idle fraction)")
        ax_bubble.set_title("bubble", fontsize=9)
        ax_bubble.legend(fontsize=7)
        for ax in (ax_rate, ax_bubble):
            ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        pp, dp, m = int(first["pp"]), int(first["dp"]), first["microbatches"]
        label = re.sub(r"_\d+$", "", path.stem.removeprefix("sweep_"))
        over = pp * dp > cores
        note = f" -- {pp * dp} ranks on {cores} cores: oversubscribed" if over else ""
        ax_rate.set_title(
            f"{label}: pp={pp} x dp={dp}, M={m}{note}\n"
            f"throughput (median, bars: min-max of {repeats} repeats)",
            fontsize=9, color="#b00000" if over else "black",
        )  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="sweep CSVs (A.csv,B.csv: one sweep), one M each")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count(),
        help="cores of the machine the sweeps ran on (default: this one's)",
    )
    args = parser.parse_args()
    sweeps = []
    for paths in args.csv:
        by_schedule = read(paths)
        path = Path(paths.split(",")[0])
        if len({r["microbatches"] for rows in by_schedule.values() for r in rows}) != 1:
            parser.exit(2, f"schedules_table.py: error: {path}: more than one M\n")
        sweeps.append((path, by_schedule))
        print(f"{path}\n\n{table(by_schedule)}\n")
    if args.plot:
        plot(sweeps, args.plot, args.cores)
        print(f"-> {args.plot}")


if __name__ == "__main__":
    main()
