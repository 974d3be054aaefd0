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

import csv
import dataclasses
import io
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np

from mpihybrid.config import ConfigError, Job, load_job, resolve
from mpihybrid.files import write_atomic
from mpihybrid.nn.kinds import model_kind
from mpihybrid.pipeline.liveness import replay_rows
from mpihybrid.pipeline.schedules import SCHEDULES, ScheduleError, chunks_for, get_spec
from mpihybrid.trace.recorder import step_times
from mpihybrid.units import table as text_table

PLOTS = ("throughput.png", "speedup.png", "bubble.png", "memory.png")
COLUMNS = (
    "schedule",
    "virtual_stages",
    "microbatches",
    "repeat",
    "pp",
    "dp",
    "global_batch",
    "microbatch_size",
    "measured_steps",
    "step_ms",
    "samples_per_s",
    "tokens_per_s",  # token data (gpt): samples_per_s x data.seq_len; empty otherwise
    "bubble_measured",
    "bubble_predicted",
    "bubble_textbook",
    "peak_inflight",  # most micro-batches alive on one stage, measured
    "peak_inflight_predicted",  # the same, from the action lists
    "peak_inflight_per_stage",  # measured, stage 0;1;...
    "peak_inflight_predicted_per_stage",
    "peak_activation_mib",  # most activation bytes alive on one rank, measured
    # most activations alive on one rank, in micro-batches of the rank's share of the model (a
    # chunk's micro-batch counts 1/chunks): measured (the last step as run), from the action
    # lists, and the zero-bubble paper's memory column for the schedule
    "peak_rank",
    "peak_rank_predicted",
    "memory_paper",
    "speedup_vs_gpipe",  # GPipe's median step time at this M / this run's step time
    "forward_ms",  # measured mean per action, averaged over stages
    "backward_ms",  # input gradient only where the schedule splits off W
    "weight_ms",
    "message_us",  # measured hop latency the prediction adds to every cross-rank dependency
    "final_loss",
)


@dataclasses.dataclass(frozen=True)
class Cell:
    schedule: str
    microbatches: int
    virtual_stages: int


# ---------------------------------------------------------------- the grid of runs


def parse_schedules(text: str) -> list[str]:
    """'all' or a comma list of schedule names, in the order given."""
    if text.strip() == "all":
        return list(SCHEDULES)
    names = [n.strip() for n in text.split(",")]
    for name in names:
        try:
            get_spec(name)
        except ScheduleError as exc:
            raise ConfigError(f"--schedules: {exc}") from None
    if len(set(names)) != len(names):
        raise ConfigError(f"--schedules {text!r}: a schedule is named twice")
    return names


def parse_microbatches(text: str) -> list[int]:
    """'2,4,8' -> [2, 4, 8]: positive integers, no repeats."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--microbatches {text!r}: expected a comma list of positive integers, e.g. 2,4,8"
        ) from None
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ConfigError(f"--microbatches {text!r}: values must be distinct integers >= 1")
    return values


def cell_job(job: Job, cell: Cell, world_size: int, fixed_batch: bool = False) -> Job:
    """The job for one cell, no trace: same micro-batch size, global batch scaled to dp * M;
    or, with fixed_batch, the job's global batch split into M micro-batches. Raises ConfigError
    when the schedule (or, fixed_batch, the global batch) rejects the combination."""
    t, dp = job.train, job.grid.dp
    microbatch_size = job.microbatch_size
    train = dataclasses.replace(
        t,
        schedule=cell.schedule,
        microbatches=cell.microbatches,
        virtual_stages=cell.virtual_stages,
        global_batch=t.global_batch if fixed_batch else microbatch_size * dp * cell.microbatches,
    )
    trace = dataclasses.replace(job.trace, path="", overwrite=False)
    return resolve(dataclasses.replace(job, train=train, trace=trace), world_size)


MAX_RUNS = 10_000  # one sweep; more is a typo or another tool's job
MAX_STEPS = 1_000_000  # training steps over all its runs


def check_size(schedules: int, microbatches: int, repeats: int, steps: int) -> None:
    """ConfigError before any cell is built when the sweep would run more than MAX_RUNS runs or
    MAX_STEPS steps in all."""
    runs = schedules * microbatches * repeats
    if runs > MAX_RUNS:
        raise ConfigError(
            f"--schedules x --microbatches x --repeats = {schedules} x {microbatches} x "
            f"{repeats} = {runs:,} runs: more than the {MAX_RUNS:,} one sweep runs"
        )
    if runs * steps > MAX_STEPS:
        raise ConfigError(
            f"{runs:,} runs x train.steps({steps:,}) = {runs * steps:,} steps: more than the "
            f"{MAX_STEPS:,} one sweep trains; fewer runs or --set train.steps=N"
        )


def plan_text(cells: list[tuple[Cell, Job]], repeats: int) -> str:
    """The plan line printed before the first run."""
    names = list(dict.fromkeys(row_label_of(cell) for cell, _ in cells))
    ms = sorted({cell.microbatches for cell, _ in cells})
    steps = cells[0][1].train.steps
    runs = len(cells) * repeats
    return (
        f"plan: {len(cells)} cells ({', '.join(names)} x M {','.join(map(str, ms))}) x "
        f"{repeats} repeat{'s' * (repeats != 1)} = {runs} runs of {steps} steps each"
    )


def row_label_of(cell: Cell) -> str:
    return f"{cell.schedule} v={cell.virtual_stages}" if cell.virtual_stages > 1 else cell.schedule


def plan(
    job: Job,
    schedules: list[str],
    microbatches: list[int],
    virtual: int,
    world_size: int,
    fixed_batch: bool = False,
) -> tuple[list[tuple[Cell, Job]], list[str]]:
    """The legal cells with their jobs, and one note per combination a schedule rejects."""
    cells, notes = [], []
    for m in microbatches:
        for name in schedules:
            cell = Cell(name, m, chunks_for(name, virtual))
            try:
                cells.append((cell, cell_job(job, cell, world_size, fixed_batch)))
            except ConfigError as exc:
                notes.append(f"skipped {name} M={m}: {exc}")
    return cells, notes


# ---------------------------------------------------------------- measurements (rank 0)


def peak_activation_bytes(events: np.ndarray, step: int) -> int:
    """Most activation bytes alive at once on one rank in `step` (replica 0): an F holds what its
    cache keeps (the event's bytes) while it is alive (liveness.replay_rows)."""
    rows = events[(events["step"] == step) & (events["replica"] == 0)]
    ranks = np.unique(rows["rank"])
    return max((replay_rows(rows[rows["rank"] == r]).peak_total_bytes for r in ranks), default=0)


def measure(summary, job: Job, cell: Cell, repeat: int, warmup_steps: int) -> dict:
    """One CSV row from a finished run's Summary."""
    from mpihybrid.analysis.metrics import bubble_summary
    from mpihybrid.pipeline.as_run import actions_as_run
    from mpihybrid.pipeline.schedules import build_schedule, placement_of
    from mpihybrid.pipeline.simulate import bubble_formula, peak_inflight, peak_per_rank

    g, t = job.grid, job.train
    name, m, v = cell.schedule, cell.microbatches, cell.virtual_stages
    measured = [t for s, t in step_times(summary.events).items() if s >= warmup_steps]
    step_s = statistics.median(measured)
    early = t.early_grad_send
    bubble = bubble_summary(summary.events, name, g.pp, m, v, warmup_steps, early)
    costs = bubble["costs"]
    placement = placement_of(name, g.pp, v)
    actions = build_schedule(name, g.pp, m, v, early)
    predicted_peaks = peak_inflight(actions, placement)
    measured_peaks = [summary.peak_inflight[s] for s in sorted(summary.peak_inflight)]
    return {
        "schedule": name,
        "virtual_stages": v,
        "microbatches": m,
        "repeat": repeat,
        "pp": g.pp,
        "dp": g.dp,
        "global_batch": t.global_batch,
        "microbatch_size": job.microbatch_size,
        "measured_steps": t.steps - warmup_steps,
        "step_ms": 1e3 * step_s,
        "samples_per_s": t.global_batch / step_s,
        "tokens_per_s": (
            t.global_batch * job.tokens_per_sample / step_s
            if model_kind(job.model.kind).tokens
            else None
        ),
        "bubble_measured": float(bubble["measured"]),
        "bubble_predicted": float(bubble["predicted"]),
        "bubble_textbook": bubble_formula(name, g.pp, m, v),
        "peak_inflight": max(measured_peaks),
        "peak_inflight_predicted": max(predicted_peaks),
        "peak_inflight_per_stage": ";".join(map(str, measured_peaks)),
        "peak_inflight_predicted_per_stage": ";".join(map(str, predicted_peaks)),
        "peak_activation_mib": peak_activation_bytes(summary.events, t.steps - 1) / 2**20,
        "peak_rank": max(
            peak_per_rank(actions_as_run(summary.events, placement, t.steps - 1), placement)
        ),
        "peak_rank_predicted": max(peak_per_rank(actions, placement)),
        "memory_paper": get_spec(name).memory_text,
        "speedup_vs_gpipe": None,
        "forward_ms": 1e3 * float(np.mean(costs["forward"])),
        "backward_ms": 1e3 * float(np.mean(costs["backward"])),
        "weight_ms": 1e3 * float(np.mean(costs["weight"])),
        "message_us": 1e6 * costs["send"],
        "final_loss": summary.losses[-1],
    }


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_gpipe = GPipe's median step time at the same M / the row's step time."""
    for m in {r["microbatches"] for r in rows}:
        gpipe = [r["step_ms"] for r in rows if r["microbatches"] == m and r["schedule"] == "gpipe"]
        if gpipe:
            reference = statistics.median(gpipe)
            for r in rows:
                if r["microbatches"] == m:
                    r["speedup_vs_gpipe"] = reference / r["step_ms"]


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


# ---------------------------------------------------------------- output (rank 0)


def row_label(row: dict) -> str:
    v = row["virtual_stages"]
    return f"{row['schedule']} v={v}" if v > 1 else row["schedule"]


def medians(rows: list[dict]) -> list[dict]:
    """One row per (schedule, M): timings and bubbles as medians over the repeats, peaks as
    maxima."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["schedule"], r["microbatches"]), []).append(r)
    out = []
    for _, group in sorted(groups.items(), key=lambda kv: (kv[0][1], schedule_order(kv[0][0]))):
        med = dict(group[0], repeats=len(group), label=row_label(group[0]))
        for key in ("step_ms", "samples_per_s", "bubble_measured", "bubble_predicted"):
            med[key] = statistics.median(r[key] for r in group)
        tokens = [r["tokens_per_s"] for r in group if r.get("tokens_per_s") is not None]
        med["tokens_per_s"] = statistics.median(tokens) if tokens else None
        med["peak_inflight"] = max(r["peak_inflight"] for r in group)
        med["peak_activation_mib"] = max(r["peak_activation_mib"] for r in group)
        speedups = [r["speedup_vs_gpipe"] for r in group if r["speedup_vs_gpipe"] is not None]
        med["speedup_vs_gpipe"] = statistics.median(speedups) if speedups else None
        # the spread over repeats, drawn around the medians: (min, max) per measured key
        for key in ("samples_per_s", "bubble_measured", "peak_activation_mib"):
            values = [r[key] for r in group]
            med[f"{key}_range"] = (min(values), max(values))
        med["speedup_vs_gpipe_range"] = (min(speedups), max(speedups)) if speedups else None
        out.append(med)
    return out


def schedule_order(name: str) -> int:
    return SCHEDULES.index(name) if name in SCHEDULES else len(SCHEDULES)  # csv: last


def format_table(rows: list[dict]) -> str:
    """Medians over repeats, one line per (M, schedule)."""
    summary = medians(rows)
    tokens = any(r.get("tokens_per_s") is not None for r in summary)  # token data: tokens/s
    header = ("M", "schedule", "step ms", "tokens/s" if tokens else "samples/s", "bubble",
              "predicted", "textbook", "error", "peak", "pred", "act MiB", "vs gpipe")  # fmt: skip
    table = [header]
    for r in summary:
        predicted = r["bubble_predicted"]
        error = (r["bubble_measured"] - predicted) / predicted if predicted > 0 else None
        speedup = r["speedup_vs_gpipe"]
        table.append(
            (
                str(r["microbatches"]),
                row_label(r),
                f"{r['step_ms']:.1f}",
                f"{r['tokens_per_s'] if tokens else r['samples_per_s']:,.0f}",
                f"{r['bubble_measured']:.3f}",
                f"{r['bubble_predicted']:.3f}",
                f"{r['bubble_textbook']:.3f}",
                "-" if error is None else f"{100 * error:+.0f}%",
                str(r["peak_inflight"]),
                str(r["peak_inflight_predicted"]),
                f"{r['peak_activation_mib']:.1f}",
                "-" if speedup is None else f"{speedup:.2f}x",
            )
        )
    return "\n".join(text_table(list(header), [list(r) for r in table[1:]], labels=0))


def check_output(path: Path, overwrite: bool) -> None:
    """Raise ConfigError now for an output the sweep could not write after all its runs."""
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise ConfigError(f"cannot write {path}: it is a directory")
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} already exists; choose another path or pass --overwrite")


def write_csv(path: Path, rows: list[dict], overwrite: bool = False) -> None:
    """All or nothing (files.write_atomic)."""
    check_output(path, overwrite)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _csv_value(r[k]) for k in COLUMNS})
    write_atomic(path, text.getvalue(), overwrite=overwrite)


def _csv_value(value):
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else value


@click.command("sweep")
@click.argument("job_file")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override one job setting (repeatable), e.g. --set train.steps=5.",
)
@click.option(
    "--schedules",
    default="all",
    show_default=True,
    help=f"'all' or a comma list: {','.join(SCHEDULES)}.",
)
@click.option(
    "--microbatches",
    "-m",
    default="2,4,8",
    show_default=True,
    help="Comma list of M (micro-batches per replica per step).",
)
@click.option("--repeats", default=3, show_default=True, help="Runs of every cell.")
@click.option(
    "--virtual",
    "-v",
    default=2,
    show_default=True,
    help="Model chunks per rank where the schedule lets it vary (interleaved-1f1b).",
)
@click.option(
    "--warmup-steps",
    default=1,
    show_default=True,
    help="Steps of each run left out of the measurements.",
)
@click.option("-o", "--output", required=True, metavar="CSV", help="One row per run.")
@click.option("--plots", metavar="DIR", help="Also draw PNGs here (needs matplotlib).")
@click.option("--overwrite", is_flag=True, help="Replace an existing CSV (and traces).")
@click.option(
    "--traces",
    metavar="DIR",
    help="Keep every run's trace: DIR/<schedule>-M<m>/repeat-<r>.h5, one directory per cell.",
)
@click.option(
    "--fixed-global-batch",
    is_flag=True,
    help="Keep the job's global batch in every cell (micro-batches shrink as M grows).",
)
@click.option("--quiet", is_flag=True, help="No progress line per run on stderr.")
def sweep(job_file, overrides, schedules, microbatches, repeats, virtual, warmup_steps,
          output, plots, overwrite, traces, fixed_global_batch, quiet) -> None:  # fmt: skip
    """Train JOB_FILE under every schedule x M x repeat in one launch; CSV, table, plots.

    The micro-batch size stays the job's, global_batch / (dp * microbatches): each cell's
    global batch is that size x dp x M (--fixed-global-batch: the job's global batch, split
    into M). Combinations a schedule rejects are skipped with a note.
    """
    from mpi4py import MPI

    from mpihybrid.cli.commands import exit_on_any_error
    from mpihybrid.cli.progress import progress_echo
    from mpihybrid.comm.device import DeviceError

    world = MPI.COMM_WORLD
    echo = click.echo if world.rank == 0 else (lambda _text: None)
    progress = progress_echo(world.rank, quiet)
    # Every rank checks the same inputs (rank 0 also the file system) and all agree on the first
    # error, so a bad sweep stops everywhere before any training message is sent.
    error, cells, notes, backend = None, [], [], None
    try:
        cells, notes, backend = _prepare(
            world, job_file, overrides, schedules, microbatches, repeats, virtual, warmup_steps,
            output, plots, overwrite, traces, fixed_global_batch,
        )  # fmt: skip
    except (ConfigError, DeviceError) as exc:
        error = str(exc)
    exit_on_any_error(world, error)

    from mpihybrid.cli.commands import exit_stopped
    from mpihybrid.train.loop import StopRequested

    for note in notes:
        echo(f"note: {note}")
    echo(plan_text(cells, repeats))
    caveat = _oversubscribed(world)
    try:
        rows = run_sweep(
            world, cells, repeats, warmup_steps, progress, backend,
            Path(traces) if traces else None, overwrite,
        )  # fmt: skip
        if rows is not None:
            write_csv(Path(output), rows, overwrite)
            echo("")
            echo(format_table(rows))
            if caveat:
                echo(f"caveat: {caveat}")
            echo(f"\n{len(rows)} runs -> {output}")
            if plots:
                from mpihybrid.cli.sweep_plots import write_plots

                title = _plot_title(job_file, cells[0][1], fixed_global_batch)
                for path in write_plots(medians(rows), Path(plots), title, caveat):
                    echo(f"plot -> {path}")
    except StopRequested as exc:  # a signal: every rank stopped at the same step boundary
        exit_stopped(world, exc)
    except BaseException:
        # One rank failing must end the whole job, never leave the others waiting.
        sys.stderr.write(f"[rank {world.rank}] sweep failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        world.Abort(1)


def _oversubscribed(world) -> str | None:
    """Collective: rank 0 gets the caveat of an oversubscribed launch, the others None."""
    import os

    from mpihybrid.sysinfo import hostname
    from mpihybrid.train.loop import oversubscribed

    hosts = world.gather((hostname(), os.cpu_count() or 1), root=0)
    message = oversubscribed(hosts) if hosts else None
    return message.split(": ranks wait")[0] + ": times measure the machine" if message else None


def _plot_title(job_file: str, job: Job, fixed_batch: bool) -> str:
    g, c = job.grid, job.comm
    batch = f"global batch {job.train.global_batch}" if fixed_batch else "micro-batch size fixed"
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


def _prepare(world, job_file, overrides, schedules, microbatches, repeats, virtual, warmup_steps,
             output, plots, overwrite, traces=None, fixed_batch=False):  # fmt: skip
    """The sweep's cells, notes and backend, after every check (ConfigError or DeviceError)."""
    from mpihybrid.comm.device import select_backend

    names = parse_schedules(schedules)
    ms = parse_microbatches(microbatches)
    for option, value, low in [("--repeats", repeats, 1), ("--virtual", virtual, 2),
                               ("--warmup-steps", warmup_steps, 0)]:  # fmt: skip
        if value < low:
            raise ConfigError(f"{option} = {value}: must be >= {low}")
    job = load_job(job_file, list(overrides), world.Get_size())
    if job.model.partition == "timed":
        raise ConfigError("model.partition = 'timed' times one layout and a sweep varies the "
                          "schedule: sweep with 'cost' or a list of layer counts")  # fmt: skip
    check_size(len(names), len(ms), repeats, job.train.steps)
    if job.train.steps <= warmup_steps:
        raise ConfigError(
            f"train.steps({job.train.steps}) must exceed --warmup-steps({warmup_steps})"
        )
    cells, notes = plan(job, names, ms, virtual, world.Get_size(), fixed_batch)
    if not cells:
        raise ConfigError("every combination was rejected: " + "; ".join(notes))
    # collective, reached by every rank alike: each has passed the same checks so far
    backend = select_backend(job.grid.device, job.comm.cuda_aware, world)
    if world.rank == 0:
        check_output(Path(output), overwrite)
        if traces:
            _prepare_traces(cells, repeats, Path(traces), overwrite)
        if plots:
            from mpihybrid.cli.sweep_plots import import_pyplot, make_directory

            import_pyplot()
            make_directory(Path(plots))
    return cells, notes, backend
