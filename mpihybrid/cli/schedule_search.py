"""`mpihybrid schedule search`: a schedule from costs and a memory limit (pipeline/search.py).

mpihybrid schedule search --pp 2 -m 4                              # unit costs
mpihybrid schedule search --job jobs/gpt_bench.toml --max-inflight 2 --csv auto.csv
mpihybrid schedule search --trace runs/zbv.h5 --placement v --time-limit 30
"""

from __future__ import annotations

import math
import sys

import click

from mpihybrid.cli.options import set_option

EXIT_USAGE = 2
MAX_PP, MAX_M = 64, 512


def _fail(message: str) -> None:
    click.echo(f"mpihybrid: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def parse_bytes(text: str) -> float:
    """'2GiB', '512M', '1e9' -> bytes (binary K/M/G/T); 'inf', '1e400': math.inf (no limit)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise ValueError(f"--memory {text!r}: give bytes or a K/M/G suffix, e.g. 2GiB")
    return value if math.isinf(value) else int(value)


def search_job(job_file: str, overrides: list[str]):
    """The job as a search times it: the whole model, its micro-batches (schedule-neutral)."""
    from mpihybrid.cli.resolve import resolve_offline

    neutral = ["train.schedule=1f1b", "train.virtual_stages=1", "model.partition=cost"]
    return resolve_offline(job_file, [*overrides, *neutral], timed=False)


@click.command("search")
@click.option(
    "--trace",
    "trace_path",
    metavar="RUN.h5",
    default=None,
    help="Costs measured in this run (per stage, its split fixed), as analyze uses them.",
)
@click.option(
    "--job",
    "job_file",
    metavar="JOB.toml",
    default=None,
    help="Costs of this job's blocks, timed here (F, B, W apart); the split is searched.",
)
@set_option("train.microbatches=8", of="setting of --job")
@click.option(
    "--pp",
    type=int,
    default=None,
    help="Pipeline ranks (default: the job's or the trace's; 4 with unit costs).",
)
@click.option(
    "--microbatches",
    "-m",
    type=int,
    default=None,
    help="Micro-batches a step (default: the job's or the trace's; 8).",
)
@click.option(
    "--max-inflight",
    type=float,
    default=None,
    help="Memory limit: micro-batches of a rank's share alive at once (default: pp).",
)
@click.option(
    "--memory",
    default=None,
    help="Memory limit in bytes per rank (e.g. 2GiB), "
    "through train/memory's model of the job (with --job).",
)
@click.option(
    "--placement", type=click.Choice(["loop", "v", "both"]), default="both", show_default=True
)
@click.option(
    "--split-bw/--no-split-bw",
    default=True,
    show_default=True,
    help="Split backwards into B (input gradient) and W (weight gradient).",
)
@click.option(
    "--time-limit",
    type=click.FloatRange(0.1, 3600),
    default=60.0,
    show_default=True,
    help="Seconds for the exact search (CP-SAT).",
)
@click.option(
    "--exact/--no-exact",
    default=True,
    show_default=True,
    help="Run the exact search where the step is small enough.",
)
@click.option("--grid/--no-grid", default=True, show_default=True)
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the schedule as torch's compute-only CSV (train.schedule=csv:FILE).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing --csv file.")
def schedule_search(
    *,
    trace_path,
    job_file,
    overrides,
    pp,
    microbatches,
    max_inflight,
    memory,
    placement,
    split_bw,
    time_limit,
    exact,
    grid,
    csv_path,
    overwrite,
):
    """Search the split and order of a schedule for measured costs under a memory limit."""
    from mpihybrid.pipeline.actions import ScheduleError
    from mpihybrid.pipeline.search import csv_of, search
    from mpihybrid.pipeline.search_report import format_result

    if trace_path and job_file:
        _fail("--trace and --job both give costs: choose one")
    if memory and max_inflight is not None:
        _fail("--memory and --max-inflight both set the limit: choose one")
    if memory and not job_file:
        _fail("--memory converts bytes through a job's memory model: give --job JOB.toml")
    if csv_path:
        from mpihybrid.files import check_target

        try:
            check_target(csv_path, overwrite)
        except (OSError, ValueError) as exc:
            _fail(f"--csv: {exc}")  # names the path, and --overwrite only where it helps
    try:
        costs, pp, m, job = _costs(trace_path, job_file, list(overrides), pp, microbatches)
        for name, value, top in (("--pp", pp, MAX_PP), ("--microbatches", m, MAX_M)):
            if not 1 <= value <= top:
                _fail(f"{name} {value}: must be between 1 and {top}")
        if memory:
            from mpihybrid.analysis.search_inputs import inflight_for_bytes

            nbytes = parse_bytes(memory)  # inf: no limit (search holds a rank's whole share)
            max_inflight = math.inf if nbytes == math.inf else inflight_for_bytes(job, nbytes)
        styles = ("loop", "v") if placement == "both" else (placement,)
        result = search(
            costs,
            pp,
            m,
            max_inflight=max_inflight,
            placements=styles,
            split=split_bw,
            time_limit=time_limit,
            exact=exact,
        )
    except (ScheduleError, ValueError, OSError) as exc:
        _fail(str(exc).splitlines()[0])
    click.echo(format_result(result, grid))
    if csv_path:
        from mpihybrid.files import write_atomic

        write_atomic(csv_path, csv_of(result), overwrite=overwrite)
        click.echo(f"wrote {csv_path} (torch's compute-only CSV, a row per pp rank)")


def _costs(trace_path, job_file, overrides, pp, m):
    """(SearchCosts, pp, M, job or None) of the options."""
    from mpihybrid.analysis.search_inputs import trace_costs
    from mpihybrid.pipeline.search_costs import job_costs, unit_costs

    if trace_path:
        from mpihybrid.trace.read import TraceError, load

        try:
            trace = load(trace_path)
        except TraceError as exc:
            raise ValueError(str(exc)) from None
        costs = trace_costs(trace, trace_path)
        tpp, tm = int(trace.attrs["pp"]), int(trace.attrs["microbatches"])
        if pp not in (None, tpp):
            raise ValueError(f"{trace_path} ran at pp={tpp}: its costs are of {tpp} ranks")
        return costs, tpp, tm if m is None else m, None
    if job_file:
        job = search_job(job_file, overrides)  # a ConfigError is a ValueError
        pp = job.grid.pp if pp is None else pp
        return job_costs(job), pp, job.train.microbatches if m is None else m, job
    pp = 4 if pp is None else pp  # 0 is refused by the caller, not read as "the default"
    return unit_costs(max(pp, 1)), pp, 8 if m is None else m, None
