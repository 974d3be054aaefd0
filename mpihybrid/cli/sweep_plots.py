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


MARKERS = "osD^vP*X"  # one per series, so lines that coincide stay visible
OFFSET = 0.035  # series i is drawn at M * 2**((i - centre) * OFFSET): apart, on the log axis


def write_plots(summary: list[dict], directory: Path, title: str = "") -> list[Path]:
    """PNGs against M, one colour and marker per schedule, from sweep.medians() rows (their
    "label" names the series), each series slightly offset along M so that equal values do not
    hide each other; bars span min..max over the repeats; where a panel holds a prediction it
    is dashed with open markers, the textbook bubble dotted. `title` heads every figure."""
    plt = import_pyplot()
    make_directory(directory)
    series: dict[str, list[dict]] = {}
    for r in summary:
        series.setdefault(r["label"], []).append(r)
    ticks = sorted({r["microbatches"] for r in summary})
    # file -> panels of (title, y label, measured key, predicted keys (dashed, dotted))
    figures = {
        "throughput.png": [("throughput", "samples / s", "samples_per_s", ())],
        "speedup.png": [("speedup over GPipe at the same M", "x GPipe", "speedup_vs_gpipe", ())],
        "bubble.png": [
            ("bubble: measured (solid), predicted from measured costs (dashed), textbook "
             "(dotted)", "idle fraction", "bubble_measured",
             ("bubble_predicted", "bubble_textbook")),
        ],
        "memory.png": [
            ("peak activations in flight, one stage (dashed: predicted)", "micro-batches",
             "peak_inflight", ("peak_inflight_predicted",)),
            ("peak activation memory, one rank (measured)", "MiB", "peak_activation_mib", ()),
        ],
    }  # fmt: skip
    paths = []
    for filename, panels in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
        for ax, panel in zip(axes[0], panels, strict=True):
            _draw_panel(ax, series, ticks, *panel)
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path = directory / filename
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _draw_panel(ax, series, ticks, title, ylabel, measured, predicted) -> None:
    """One panel: each series' measured medians with min-max bars, and its predictions."""
    centre = (len(series) - 1) / 2
    for i, (label, points) in enumerate(series.items()):
        ys = [p[measured] for p in points]
        if all(y is None for y in ys):
            continue
        shift = 2 ** ((i - centre) * OFFSET)
        ms = [p["microbatches"] * shift for p in points]
        style = {"color": f"C{i}", "marker": MARKERS[i % len(MARKERS)], "ms": 6}
        spread = [p.get(f"{measured}_range") for p in points]
        if all(s is not None for s in spread):
            lows = [y - lo for y, (lo, _) in zip(ys, spread, strict=True)]
            highs = [hi - y for y, (_, hi) in zip(ys, spread, strict=True)]
            err = [lows, highs]
            ax.errorbar(ms, ys, yerr=err, ls="-", capsize=3, label=label, **style)
        else:
            ax.plot(ms, ys, ls="-", label=label, **style)
        for key, ls in zip(predicted, ("--", ":"), strict=False):
            ax.plot(ms, [p[key] for p in points], ls=ls, mfc="none", alpha=0.8, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels=[str(m) for m in ticks])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches per step (M)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


# ---------------------------------------------------------------- the command
