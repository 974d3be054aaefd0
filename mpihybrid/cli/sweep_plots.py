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


def write_plots(
    summary: list[dict], directory: Path, title: str = "", caveat: str | None = None
) -> list[Path]:
    """PNGs against M, one colour and marker per schedule, from sweep_rows.medians() rows (their
    "label" names the series), each series slightly offset along M so that equal values do not
    hide each other. Measured medians are solid with bars from the fastest to the slowest of
    the repeats, predictions dashed with open markers on top, the textbook bubble dotted, one
    black line per distinct formula; the legend says all of it. `title` heads every figure,
    `caveat` (an oversubscribed machine) goes under it in red."""
    plt = import_pyplot()
    make_directory(directory)
    series: dict[str, list[dict]] = {}
    for r in summary:
        series.setdefault(r["label"], []).append(r)
    ticks = sorted({r["microbatches"] for r in summary})
    repeats = max((r.get("repeats", 1) for r in summary), default=1)
    tokens = any(r.get("tokens_per_s") is not None for r in summary)
    # file -> panels of (title, y label, measured key, predicted key, textbook key, from zero)
    figures = {
        "throughput.png": [("throughput", "tokens / s", "tokens_per_s", None, None, True)]
        if tokens
        else [("throughput", "samples / s", "samples_per_s", None, None, True)],
        "speedup.png": [
            ("speedup over GPipe at the same M", "x GPipe", "speedup_vs_gpipe", None, None, True)
        ],
        "bubble.png": [
            (
                "bubble: the idle fraction of the pipeline phase",
                "idle fraction",
                "bubble_measured",
                "bubble_predicted",
                "bubble_textbook",
                True,
            ),
        ],
        "memory.png": [
            (
                "peak activations in flight, one stage",
                "micro-batches",
                "peak_inflight",
                "peak_inflight_predicted",
                None,
                True,
            ),
            (
                "peak activation memory, one rank (measured)",
                "MiB",
                "peak_activation_mib",
                None,
                None,
                True,
            ),
        ],
    }
    paths = []
    for filename, panels in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 6.2), squeeze=False)
        for ax, panel in zip(axes[0], panels, strict=True):
            _draw_panel(ax, series, ticks, repeats, **dict(zip(PANEL_KEYS, panel, strict=True)))
        heading = "\n".join(t for t in (title, caveat) if t)
        if heading:
            fig.suptitle(heading, fontsize=10, color="#b00000" if caveat else "black")
        fig.tight_layout()
        path = directory / filename
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# a panel's settings, in the order figures lists them
PANEL_KEYS = ("title", "ylabel", "measured", "predicted", "textbook", "zero")


def _draw_panel(
    ax, series, ticks, repeats, *, title, ylabel, measured, predicted, textbook, zero
) -> None:
    """One panel: each series' measured medians with min-max bars, its prediction dashed on
    top, the textbook values dotted (one line per distinct set), a legend naming every style."""
    from matplotlib.lines import Line2D

    centre = (len(series) - 1) / 2
    textbooks: dict[tuple, list[str]] = {}  # values -> the schedules that share them
    for i, (label, points) in enumerate(series.items()):
        ys = [p[measured] for p in points]
        if all(y is None for y in ys):
            continue
        shift = 2 ** ((i - centre) * OFFSET)
        ms = [p["microbatches"] * shift for p in points]
        style = {"color": f"C{i}", "marker": MARKERS[i % len(MARKERS)], "ms": 6}
        spread = [p.get(f"{measured}_range") for p in points]
        if repeats > 1 and all(s is not None for s in spread):
            lows = [y - lo for y, (lo, _) in zip(ys, spread, strict=True)]
            highs = [hi - y for y, (_, hi) in zip(ys, spread, strict=True)]
            ax.errorbar(ms, ys, yerr=[lows, highs], ls="-", capsize=3, label=label, **style)
        else:
            ax.plot(ms, ys, ls="-", label=label, **style)
        if predicted:
            ax.plot(ms, [p[predicted] for p in points], ls="--", mfc="white", zorder=3, **style)
        if textbook:
            key = tuple((p["microbatches"], round(p[textbook], 6)) for p in points)
            textbooks.setdefault(key, []).append(label)
    handles, labels = ax.get_legend_handles_labels()
    for key, names in textbooks.items():
        (line,) = ax.plot([m for m, _ in key], [y for _, y in key], ls=":", color="black", lw=1.2)
        handles.append(line)
        labels.append(f"textbook: {' = '.join(names)}")
    spread = f", bars: fastest to slowest of {repeats} repeats" if repeats > 1 else ""
    styles = [("-", "o", f"measured (median{spread})")]
    if predicted:
        styles.append(("--", "o", "predicted (dashed, open)"))
    for ls, marker, text in styles:
        handles.append(Line2D([], [], color="grey", ls=ls, marker=marker, mfc="white"))
        labels.append(text)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels=[str(m) for m in ticks])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches per step (M)")
    ax.set_ylabel(ylabel)
    if zero:
        ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    # under the axes: a legend inside would sit on the lines it names
    ax.legend(handles, labels, fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))


# ---------------------------------------------------------------- the command
