"""Plots of a schedule sweep (the `plot` extra): throughput, speedup over GPipe, bubble
measured vs predicted, peak activation memory, each against the number of micro-batches."""

from __future__ import annotations

from pathlib import Path

from mpihybrid.config import ConfigError


def import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plots needs matplotlib: pip install 'mpihybrid[plot]' (or pip install matplotlib)"
        ) from None
    return plt


def make_directory(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--plots {path}: cannot create the directory ({exc.strerror})") from None


def write_plots(summary: list[dict], directory: Path) -> list[Path]:
    """PNGs against M, one colour per schedule, from sweep.medians() rows (their "label" names
    the series); where a panel holds a prediction it is dashed with open markers next to the
    measurement."""
    plt = import_pyplot()
    make_directory(directory)
    series: dict[str, list[dict]] = {}
    for r in summary:
        series.setdefault(r["label"], []).append(r)
    ticks = sorted({r["microbatches"] for r in summary})
    # file -> panels of (title, y label, measured key, predicted key or None)
    figures = {
        "throughput.png": [("throughput", "samples / s", "samples_per_s", None)],
        "speedup.png": [("speedup over GPipe at the same M", "x GPipe", "speedup_vs_gpipe", None)],
        "bubble.png": [
            ("bubble: measured vs predicted (dashed) from measured costs", "idle fraction",
             "bubble_measured", "bubble_predicted"),
        ],
        "memory.png": [
            ("peak activations in flight, one stage (dashed: predicted)", "micro-batches",
             "peak_inflight", "peak_inflight_predicted"),
            ("peak activation memory, one rank (measured)", "MiB", "peak_activation_mib", None),
        ],
    }  # fmt: skip
    paths = []
    for filename, panels in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        for ax, (title, ylabel, measured, predicted) in zip(axes[0], panels, strict=True):
            for i, (label, points) in enumerate(series.items()):
                ms = [p["microbatches"] for p in points]
                ys = [p[measured] for p in points]
                if all(y is None for y in ys):
                    continue
                ax.plot(ms, ys, "-o", color=f"C{i}", label=label)
                if predicted:
                    ax.plot(ms, [p[predicted] for p in points], "--o", color=f"C{i}", mfc="none")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, labels=[str(m) for m in ticks])
            ax.minorticks_off()
            ax.set_xlabel("micro-batches per step (M)")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = directory / filename
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------- the command
