"""Schedule sweep: one mpiexec launch trains a job under every schedule x M x repeat, in-process.

    mpiexec -n 2 mpihybrid sweep jobs/bench_pp2.toml --schedules all --microbatches 2,4,8 \
        --repeats 3 -o runs/sweep.csv --plots runs/sweep

Each cell keeps the job's micro-batch size (global_batch / (dp * M_job)) and scales the global
batch with M, so every schedule does the same work per micro-batch and only the overlap differs.
Per run: step time (median over the steps after warm-up, first start to last end over ranks),
throughput, the bubble measured from the trace and predicted from the run's own measured costs,
the textbook closed form, peak activations in flight per stage (measured, and from the action
lists), and the speedup over GPipe at the same M (median step times over repeats).
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import click

from mpihybrid.cli.options import set_option
from mpihybrid.cli.sweep_plan import (
    Cell,
    check_size,
    parse_microbatches,
    parse_schedules,
    plan,
    plan_text,
)
from mpihybrid.cli.sweep_rows import (
    add_speedups,
    check_output,
    format_table,
    measure,
    medians,
    row_label,
    write_csv,
)
from mpihybrid.config import ConfigError, Job, load_job
from mpihybrid.pipeline.schedules import SCHEDULES

PLOTS = ("throughput.png", "speedup.png", "bubble.png", "memory.png")


def cell_dir(traces: Path, cell: Cell) -> Path:
    """One cell's directory of traces, a file per repeat: 1f1b-M4, interleaved-1f1b-v2-M8, ..."""
    v = f"-v{cell.virtual_stages}" if cell.virtual_stages > 1 else ""
    return traces / f"{cell.schedule}{v}-M{cell.microbatches}"


def trace_path(traces: Path, cell: Cell, repeat: int) -> Path:
    return cell_dir(traces, cell) / f"repeat-{repeat + 1}.h5"


def with_trace(job: Job, path: Path, overwrite: bool) -> Job:
    """The cell's job writing its trace to `path`, flushed once at the end (so the Summary
    keeps every event for the measurements)."""
    trace = dataclasses.replace(
        job.trace, path=str(path), overwrite=overwrite, flush_steps=0, flush_seconds=0.0
    )
    return dataclasses.replace(job, trace=trace)


def run_sweep(
    world,
    cells: list[tuple[Cell, Job]],
    *,
    repeats: int,
    warmup_steps: int,
    echo: Callable[[str], None],
    backend=None,
    traces: Path | None = None,
    overwrite: bool = False,
) -> list[dict] | None:
    """Train every cell `repeats` times (repeat-major, so drift spreads over all cells); rank 0
    returns one row per run, the other ranks None. echo gets a progress line per run; traces:
    keep each run's trace in the cell's directory there."""
    from mpihybrid.train.loop import train

    rows, total = [], repeats * len(cells)
    for repeat in range(repeats):
        for cell, job in cells:
            if traces is not None:
                job = with_trace(job, trace_path(traces, cell, repeat), overwrite)
            summary = train(job, world, quiet=True, backend=backend)
            if summary is None:
                continue
            row = measure(summary, job, cell, repeat, warmup_steps)
            rows.append(row)
            echo(
                f"[{len(rows):>{len(str(total))}}/{total}] {row_label(row)} M={row['microbatches']}"
                f" repeat {repeat + 1}: {row['step_ms']:.1f} ms/step, bubble"
                f" {row['bubble_measured']:.3f} (predicted {row['bubble_predicted']:.3f})"
            )
    if world.rank != 0:
        return None
    add_speedups(rows)
    return rows


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """The sweep command's options, by name (its click options below say what each means)."""

    schedules: str
    microbatches: str
    repeats: int
    virtual: int
    warmup_steps: int
    output: str
    plots: str | None
    overwrite: bool
    traces: str | None
    fixed_global_batch: bool
    quiet: bool


# the sweep command's options, in --help order (SweepOptions names them)
_OPTIONS = [
    set_option("train.steps=5"),
    click.option(
        "--schedules",
        default="all",
        show_default=True,
        help=f"A comma list of {','.join(SCHEDULES)}, auto (searched for the job at each M), "
        "or all (the nine).",
    ),
    click.option(
        "--microbatches",
        "-m",
        default="2,4,8",
        show_default=True,
        help="Comma list of M (micro-batches per replica per step).",
    ),
    click.option("--repeats", default=3, show_default=True, help="Runs of every cell."),
    click.option(
        "--virtual",
        "-v",
        default=2,
        show_default=True,
        help="Model chunks per rank where the schedule lets it vary (interleaved-1f1b).",
    ),
    click.option(
        "--warmup-steps",
        default=1,
        show_default=True,
        help="Steps of each run left out of the measurements.",
    ),
    click.option("-o", "--output", required=True, metavar="CSV", help="One row per run."),
    click.option("--plots", metavar="DIR", help="Also draw PNGs here (needs matplotlib)."),
    click.option("--overwrite", is_flag=True, help="Replace an existing CSV (and traces)."),
    click.option(
        "--traces",
        metavar="DIR",
        help="Keep every run's trace: DIR/<schedule>-M<m>/repeat-<r>.h5, one directory per cell.",
    ),
    click.option(
        "--fixed-global-batch",
        is_flag=True,
        help="Keep the job's global batch in every cell (micro-batches shrink as M grows).",
    ),
    click.option("--quiet", is_flag=True, help="No progress line per run on stderr."),
]


def _with_options(command):
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


@click.command("sweep")
@click.argument("job_file")
@_with_options
def sweep(job_file, overrides, **options) -> None:
    """Train JOB_FILE under every schedule x M x repeat in one launch; CSV, table, plots.

    The micro-batch size stays the job's, global_batch / (dp * microbatches): each cell's
    global batch is that size x dp x M (--fixed-global-batch: the job's global batch, split
    into M). Combinations a schedule rejects are skipped with a note.
    """
    from mpi4py import MPI

    from mpihybrid.cli.commands import exit_on_any_error
    from mpihybrid.cli.progress import progress_echo
    from mpihybrid.comm.device import DeviceError

    opts = SweepOptions(**options)
    world = MPI.COMM_WORLD
    echo = click.echo if world.rank == 0 else (lambda _text: None)
    progress = progress_echo(world.rank, opts.quiet)
    # Every rank checks the same inputs (rank 0 also the file system) and all agree on the first
    # error, so a bad sweep stops everywhere before any training message is sent.
    error, cells, notes, backend = None, [], [], None
    try:
        cells, notes, backend = _prepare(world, job_file, overrides, opts)
    except (ConfigError, DeviceError) as exc:
        error = str(exc)
    exit_on_any_error(world, error)

    from mpihybrid.cli.commands import exit_stopped
    from mpihybrid.train.loop import StopRequested

    for note in notes:
        echo(f"note: {note}")
    echo(plan_text(cells, opts.repeats))
    caveat = _oversubscribed(world)
    try:
        rows = run_sweep(
            world,
            cells,
            repeats=opts.repeats,
            warmup_steps=opts.warmup_steps,
            echo=progress,
            backend=backend,
            traces=Path(opts.traces) if opts.traces else None,
            overwrite=opts.overwrite,
        )
        if rows is not None:
            _report(rows, opts, echo, caveat, _plot_title(job_file, cells[0][1], opts))
    except StopRequested as exc:  # a signal: every rank stopped at the same step boundary
        exit_stopped(world, exc)
    except BaseException:
        # One rank failing must end the whole job, never leave the others waiting.
        sys.stderr.write(f"[rank {world.rank}] sweep failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        world.Abort(1)


def _report(rows: list[dict], opts: SweepOptions, echo, caveat: str | None, title: str) -> None:
    """Rank 0: the CSV, the table of medians, the caveat and the plots."""
    write_csv(Path(opts.output), rows, opts.overwrite)
    echo("")
    echo(format_table(rows))
    if caveat:
        echo(f"caveat: {caveat}")
    echo(f"\n{len(rows)} runs -> {opts.output}")
    if opts.plots:
        from mpihybrid.cli.sweep_plots import write_plots

        for path in write_plots(medians(rows), Path(opts.plots), title, caveat):
            echo(f"plot -> {path}")


def _oversubscribed(world) -> str | None:
    """Collective: rank 0 gets the caveat of an oversubscribed launch, the others None."""
    import os

    from mpihybrid.sysinfo import hostname
    from mpihybrid.train.tracing import oversubscribed

    hosts = world.gather((hostname(), os.cpu_count() or 1), root=0)
    message = oversubscribed(hosts) if hosts else None
    return message.split(": ranks wait")[0] + ": times measure the machine" if message else None


def _plot_title(job_file: str, job: Job, opts: SweepOptions) -> str:
    g, c = job.grid, job.comm
    fixed = opts.fixed_global_batch
    batch = f"global batch {job.train.global_batch}" if fixed else "micro-batch size fixed"
    return f"{Path(job_file).name}: pp={g.pp} x dp={g.dp}, codec {c.codec}, {batch}"


def _prepare_traces(cells: list[tuple[Cell, Job]], repeats: int, traces: Path, overwrite: bool):
    """Rank 0: each cell's trace directory, and no trace there that would be replaced unasked."""
    for cell, _ in cells:
        try:
            cell_dir(traces, cell).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = f"--traces {traces}: cannot create {exc.filename} ({exc.strerror})"
            raise ConfigError(why) from None
        for repeat in range(repeats):
            path = trace_path(traces, cell, repeat)
            if path.exists() and not overwrite:
                raise ConfigError(f"{path} already exists; choose another --traces or --overwrite")


def _prepare(world, job_file: str, overrides, opts: SweepOptions):
    """The sweep's cells, notes and backend, after every check (ConfigError or DeviceError)."""
    from mpihybrid.cli.resolve import rewrite
    from mpihybrid.comm.device import select_backend

    names = parse_schedules(opts.schedules)
    ms = parse_microbatches(opts.microbatches)
    repeats, warmup_steps = opts.repeats, opts.warmup_steps
    for option, value, low in [
        ("--repeats", repeats, 1),
        ("--virtual", opts.virtual, 2),
        ("--warmup-steps", warmup_steps, 0),
    ]:
        if value < low:
            raise ConfigError(f"{option} = {value}: must be >= {low}")
    job = load_job(job_file, list(overrides), world.Get_size())
    if job.model.partition == "timed":
        raise ConfigError(
            "model.partition = 'timed' times one layout and a sweep varies the "
            "schedule: sweep with 'cost' or a list of layer counts"
        )
    check_size(len(names), len(ms), repeats, job.train.steps)
    if job.train.steps <= warmup_steps:
        raise ConfigError(
            f"train.steps({job.train.steps}) must exceed --warmup-steps({warmup_steps})"
        )
    cells, notes = plan(
        job, names, ms, opts.virtual, world.Get_size(), fixed_batch=opts.fixed_global_batch
    )
    if not cells:
        raise ConfigError("every combination was rejected: " + "; ".join(notes))
    # collective, reached by every rank alike: an auto cell's schedule searched on rank 0 (bad
    # costs or a limit nothing meets: one line, exit 2 on every rank)
    cells = [(cell, rewrite(cell_job, world)[0]) for cell, cell_job in cells]
    # collective, reached by every rank alike: each has passed the same checks so far
    backend = select_backend(job.grid.device, job.comm.cuda_aware, world)
    if world.rank == 0:
        check_output(Path(opts.output), opts.overwrite)
        if opts.traces:
            _prepare_traces(cells, repeats, Path(opts.traces), opts.overwrite)
        if opts.plots:
            from mpihybrid.cli.sweep_plots import import_pyplot, make_directory

            import_pyplot()
            make_directory(Path(opts.plots))
    return cells, notes, backend
