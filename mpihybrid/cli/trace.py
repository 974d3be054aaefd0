"""Trace commands: analyze, timeline, export, compare (registered by mpihybrid.cli).

mpihybrid analyze runs/seed.h5 [--json]
mpihybrid timeline runs/seed.h5 -o runs/seed.png [--steps 2:4] [--ascii]
mpihybrid export runs/seed.h5 --format chrome -o runs/seed.json
mpihybrid compare runs/1f1b.h5 runs/gpipe.h5 runs/zb.h5
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from mpihybrid.cli.commands import EXIT_USAGE

# keys every run has its own value for: not a difference worth a row
_NOT_COMPARED = ("trace.path", "trace.overwrite")


def _fail(message: str) -> None:
    click.echo(f"mpihybrid: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def _load(path: str):
    from mpihybrid.trace.read import TraceError, load

    try:
        return load(path)
    except TraceError as exc:
        _fail(str(exc))


def _analyze(trace, path: str) -> dict:
    from mpihybrid.analysis.metrics import analyze as run_analysis
    from mpihybrid.pipeline.schedules import ScheduleError

    if not len(trace.events):
        _fail(f"{path} holds no events (the run stopped before its first flush?)")
    world = trace.attrs.get("world_size")
    present = len(set(trace.events["rank"].tolist()))
    if world is not None and present < int(world):
        _fail(f"{path} holds the events of {present} of {world} ranks: not a whole run")
    try:
        return run_analysis(trace)
    except (KeyError, ValueError, ScheduleError) as exc:
        _fail(f"{path}: cannot analyse this trace ({type(exc).__name__}: {exc})")


def _not_the_input(output: str, run: str) -> None:
    """Refuse an output path that is the input trace (writing it would replace the trace)."""
    import os

    same = Path(output).resolve() == Path(run).resolve()
    if not same and Path(output).exists() and Path(run).exists():
        same = os.path.samefile(output, run)
    if same:
        _fail(f"{output} is the input trace: choose another output path")


def _write(write) -> None:
    """Call write() and turn the file-system refusals into one error line."""
    try:
        write()
    except (FileExistsError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        _fail(str(exc))


@click.command()
@click.argument("run", metavar="RUN.h5")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON instead.")
def analyze(run, as_json) -> None:
    """Where the time went in RUN.h5: compute / p2p wait / all-reduce / idle per rank and stage,
    bubble measured vs predicted, bytes, all-reduce algbw/busbw, throughput, activation memory."""
    import json

    from mpihybrid.analysis.cause import why
    from mpihybrid.analysis.metrics import STEPS_ONLY
    from mpihybrid.analysis.report import format_analysis

    trace = _load(run)
    result = _analyze(trace, run)
    if result.get("events") != STEPS_ONLY:
        result["why"] = why(trace, result["bubble"]["steps"], run)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"{run}\n{format_analysis(result)}")


@click.command()
@click.argument("runs", nargs=-1, required=True, metavar="RUN.h5 [MORE.h5 ...]")
@click.option("-o", "--output", metavar="OUT.png", help="PNG to write (default: RUN.png).")
@click.option("--step", type=int, help="The step to draw, from 1 (default: the last).")
@click.option("--steps", "step_span", metavar="A:B", help="Draw steps A to B (from 1), e.g. 2:4.")
@click.option("--ascii", "as_ascii", is_flag=True, help="Print the step x rank grid instead.")
@click.option("--replica", type=int, default=0, show_default=True, help="Replica for --ascii.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
def timeline(*, runs, output, step, step_span, as_ascii, replica, overwrite) -> None:
    """Gantt chart of RUN.h5: one row per rank, a colour per event kind, micro-batch numbers on
    the F/B/W bars; several runs stack on one time axis (1F1B above GPipe, say); or, with
    --ascii, the step x rank grid of the order each rank ran."""
    from mpihybrid.analysis.timeline import ascii_timeline, step_range, steps_text, write_png

    if step is not None and step_span is not None:
        _fail("give --step or --steps, not both")
    if len(runs) > 1 and (as_ascii or output is None):
        _fail("several runs draw one stacked PNG: give -o OUT.png (and no --ascii)")
    traces, spans = [], []
    for run in runs:
        trace = _load(run)
        try:
            spans.append(step_range(trace, step if step is not None else step_span))
        except ValueError as exc:
            _fail(f"{run}: {exc}")
        traces.append(trace)
    run, trace, steps = runs[0], traces[0], spans[0]
    if as_ascii:
        try:
            click.echo("\n\n".join(ascii_timeline(trace, s, replica) for s in steps))
        except ValueError as exc:
            _fail(f"{run}: {exc}")
        if output is None:
            return
    out = output or str(Path(run).with_suffix(".png"))
    for each in runs:
        _not_the_input(out, each)
    if Path(out).exists() and not overwrite:
        _fail(f"{out} already exists (--overwrite replaces it)")
    labels = short_labels(list(runs)) if len(runs) > 1 else None
    try:
        _write(lambda: write_png(traces, out, spans, overwrite, labels))
    except (ImportError, ValueError) as exc:
        _fail(f"{run}: {exc}" if isinstance(exc, ValueError) and len(runs) == 1 else str(exc))
    if len(runs) == 1:
        click.echo(f"wrote {out} ({steps_text(steps)})")
    else:
        click.echo(f"wrote {out} ({len(runs)} runs stacked on one time axis)")


@click.command()
@click.argument("run", metavar="RUN.h5")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["chrome", "csv"]),
    required=True,
    help="chrome: trace-event JSON (ui.perfetto.dev, chrome://tracing); csv: a row per event.",
)
@click.option("-o", "--output", required=True, metavar="OUT", help="File to write.")
@click.option("--steps", "step_span", metavar="A:B", help="Export steps A to B (from 1) only.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
def export(run, fmt, output, step_span, overwrite) -> None:
    """Export RUN.h5 for other tools: Chrome/Perfetto JSON (a process per rank, flow arrows from
    each send to its receive) or CSV; steps are counted from 1 in both."""
    from mpihybrid.analysis.export import export as write_export
    from mpihybrid.analysis.export import window
    from mpihybrid.analysis.timeline import step_range, steps_text

    _not_the_input(output, run)
    if Path(output).exists() and not overwrite:
        _fail(f"{output} already exists (--overwrite replaces it)")
    trace = _load(run)
    steps = None
    if step_span is not None:
        try:
            steps = step_range(trace, step_span)
        except ValueError as exc:
            _fail(f"{run}: {exc}")
    n = len(window(trace, steps).events)
    _write(lambda: write_export(trace, output, fmt, overwrite, steps))
    what = f", {steps_text(steps)}" if steps is not None else ""
    click.echo(f"wrote {output} ({n} events{what}, {fmt})")


@click.command()
@click.argument("runs", nargs=-1, required=True, metavar="A.h5 B.h5 ...")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON instead.")
def compare(runs, as_json) -> None:
    """Compare runs side by side: the settings that differ, then step time, bubble, bytes,
    throughput and accuracy, each with its ratio to the first run. Every figure comes from
    each run's measured window (its traced steps after the first), as analyze shows it."""
    from mpihybrid.analysis.metrics import flat_config
    from mpihybrid.analysis.oversubscription import oversubscription_text
    from mpihybrid.analysis.report import window_text
    from mpihybrid.units import human_bytes, table

    if len(runs) < 2:
        _fail("compare needs at least two traces")
    traces = [_load(r) for r in runs]
    results = [_analyze(t, r) for t, r in zip(traces, runs, strict=True)]
    configs = [flat_config(t) for t in traces]
    keys = sorted({k for c in configs for k in c} - set(_NOT_COMPARED))
    differ = [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]
    labels = short_labels(runs)
    if as_json:
        import json

        doc = _compare_json(runs, labels, results, configs, differ)
        if len(runs) == 2:
            from mpihybrid.analysis.diff import diff

            doc["actions"] = diff(*traces, *runs)
        click.echo(json.dumps(doc, indent=2))
        return
    rows = [[k, *(str(c.get(k, "-")) for c in configs)] for k in differ]
    rows.append(["measured window", *(window_text(r["window"]) for r in results)])

    def metric(label: str, get, fmt) -> list[str]:
        values = [get(r) for r in results]
        cells = []
        for value in values:
            if value is None:
                cells.append("-")
                continue
            ratio = f" ({value / values[0]:.2f}x)" if values[0] else ""
            cells.append(fmt(value) + ratio)
        return [label, *cells]

    def ms(x: float) -> str:
        return f"{1e3 * x:.2f} ms"

    rows += [
        metric("step time (mean)", lambda r: r["step_time"]["mean"], ms),
        metric("step time (median)", lambda r: r["step_time"]["median"], ms),
        metric("bubble measured", lambda r: r["bubble"]["measured"], "{:.3f}".format),
        metric("bubble predicted", lambda r: r["bubble"]["predicted"], "{:.3f}".format),
        metric("bytes activation", lambda r: r["bytes"]["activation"], human_bytes),
        metric("bytes activation_grad", lambda r: r["bytes"]["activation_grad"], human_bytes),
        metric("bytes all-reduce", lambda r: r["bytes"]["allreduce"], human_bytes),
        metric("samples/s", lambda r: r["throughput"]["samples_per_s"], "{:,.0f}".format),
        metric("tokens/s", lambda r: r["throughput"].get("tokens_per_s"), "{:,.0f}".format),
        metric("final loss", lambda r: r["quality"]["final_loss"], "{:.4f}".format),
        metric("train accuracy", lambda r: r["quality"]["train_accuracy"], "{:.3f}".format),
        metric("held-out accuracy", lambda r: r["quality"]["test_accuracy"], "{:.3f}".format),
    ]
    rows = [r for r in rows if r[0] != "tokens/s" or any(c != "-" for c in r[1:])]
    click.echo("\n".join(table(["", *labels], rows)))
    if len(runs) == 2:
        from mpihybrid.analysis.diff import diff, diff_lines

        click.echo("\n".join(diff_lines(diff(*traces, *runs), labels)))
    for label, result in zip(labels, results, strict=True):
        caveat = oversubscription_text(result["run"].get("oversubscribed"))
        if caveat:
            click.echo(f"{label}: {caveat}")


# the figures compare shows, as (JSON name, path into an analyze() result)
_COMPARED = (
    ("step_time_mean_s", ("step_time", "mean")),
    ("step_time_median_s", ("step_time", "median")),
    ("bubble_measured", ("bubble", "measured")),
    ("bubble_predicted", ("bubble", "predicted")),
    ("bytes_activation", ("bytes", "activation")),
    ("bytes_activation_grad", ("bytes", "activation_grad")),
    ("bytes_allreduce", ("bytes", "allreduce")),
    ("samples_per_s", ("throughput", "samples_per_s")),
    ("tokens_per_s", ("throughput", "tokens_per_s")),
    ("final_loss", ("quality", "final_loss")),
    ("train_accuracy", ("quality", "train_accuracy")),
    ("test_accuracy", ("quality", "test_accuracy")),
)


def _compare_json(runs, labels, results, configs, differ) -> dict:
    """compare --json: every run's settings that differ, its window and figures, and each
    figure's ratio to the first run's (None where either is missing or the first is 0)."""

    def get(result: dict, path: tuple[str, str]):
        return (result.get(path[0]) or {}).get(path[1])

    out = []
    for path, label, result, config in zip(runs, labels, results, configs, strict=True):
        figures = {name: get(result, where) for name, where in _COMPARED}
        ratios = {}
        for name, where in _COMPARED:
            first, mine = get(results[0], where), figures[name]
            ratios[name] = mine / first if first and mine is not None else None
        out.append(
            {
                "path": path,
                "label": label,
                "settings": {k: config.get(k) for k in differ},
                "window": result.get("window"),
                "oversubscribed": result["run"].get("oversubscribed"),
                "figures": figures,
                "ratio_to_first": ratios,
            }
        )
    return {"differ": differ, "runs": out}


def short_labels(paths: list[str]) -> list[str]:
    """Each path's last few components, as few as keep the labels apart (runs/a/trace.h5 and
    runs/b/trace.h5 -> a/trace.h5, b/trace.h5); the whole path when nothing shorter does."""
    parts = [Path(p).resolve().parts for p in paths]
    for n in range(1, max(len(p) for p in parts) + 1):
        labels = [str(Path(*p[-n:])) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]
