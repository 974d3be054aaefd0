"""`mpihybrid schedule show`: a schedule's step x rank grid, bubble and peak activations.

mpihybrid schedule show --schedule 1f1b --pp 4 --microbatches 8
"""

from __future__ import annotations

import click

from mpihybrid.cli.commands import (
    _fail,
)
from mpihybrid.cli.schedule_search import schedule_search  # click alone at import
from mpihybrid.pipeline.schedules import SCHEDULES
from mpihybrid.pipeline.simulate import GRID_RANKS, GRID_ROWS


@click.group()
def schedule() -> None:
    """Pipeline schedules as data: grids, predicted bubbles, peak activations."""


@schedule.command("show")
@click.option(
    "--schedule",
    "name",
    default="1f1b",
    show_default=True,
    help=" | ".join(SCHEDULES) + " | csv:PATH (torch's compute-only CSV)",
)
@click.option("--pp", type=int, default=4, show_default=True, help="Pipeline stages.")
@click.option("--microbatches", "-m", type=int, default=8, show_default=True)
@click.option(
    "--virtual",
    "-v",
    type=int,
    default=None,
    help="Model chunks per rank (interleaved-1f1b; default 2; a V schedule runs 2).",
)
@click.option("--all", "show_all", is_flag=True, help="Compare every schedule in one table.")
@click.option(
    "--early-grad-send",
    is_flag=True,
    help="As training runs it (train.early_grad_send): a backward whose gradient goes to "
    "another rank is B, send, then W.",
)
@click.option(
    "--merge-w",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="As train.merge_w: each stage's W passes merged in groups of up to this many "
    "micro-batches (one GEMM per weight; 1: none).",
)
@click.option(
    "--grid",
    type=click.Choice(["auto", "full", "none"]),
    default="auto",
    show_default=True,
    help=f"auto: past {GRID_RANKS} ranks or {GRID_ROWS} rows, the first and last only.",
)
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write the schedule as torch.distributed.pipelining's compute-only CSV "
    '(_dump_csv; train.schedule = "csv:FILE" reads it back).',
)
@click.option(
    "--trace",
    "trace_path",
    metavar="RUN.h5",
    default=None,
    help="The schedule a traced run ran: its schedule, pp, M, v and early gradient sends "
    "(a csv: schedule from the trace's copy of the file).",
)
@click.option(
    "--vocab-parallel",
    is_flag=True,
    help="With model.vocab_parallel's passes on every rank (S, T; E and G take no step).",
)
def schedule_show(
    *,
    name,
    pp,
    microbatches,
    virtual,
    show_all,
    early_grad_send,
    merge_w,
    grid,
    csv_path,
    trace_path,
    vocab_parallel,
):
    """Print a schedule's step x rank grid, predicted bubble and peak activations."""
    from mpihybrid.pipeline.csv_schedule import dump_csv, from_trace
    from mpihybrid.pipeline.plan import make_schedule, spec_of
    from mpihybrid.pipeline.schedules import ScheduleError, chunks_for
    from mpihybrid.pipeline.simulate import compare, describe, simulate, unit_costs

    copy = None  # a trace's copy of its csv: schedule's text
    if show_all and (csv_path or trace_path):
        _fail(f"{'--csv' if csv_path else '--trace'} shows one schedule, not --all")
    if trace_path:
        from mpihybrid.trace.read import TraceError, load

        try:
            attrs = load(trace_path).attrs
        except TraceError as exc:
            _fail(str(exc))
        (name, copy), pp = from_trace(attrs), int(attrs["pp"])
        microbatches = int(attrs["microbatches"])
        virtual = int(attrs.get("virtual_stages", 1))
        early_grad_send = bool(attrs.get("early_grad_send", False))
        merge_w = int(attrs.get("merge_w", 1))
        vocab_parallel = bool(attrs.get("vocab_parallel", False))
    try:
        spec = spec_of(name, copy)  # a trace's csv: schedule: of its copy of the CSV
        v = virtual if virtual is not None else (2 if show_all else chunks_for(spec))
        _check_schedule_size(pp, microbatches, v)
        if vocab_parallel and csv_path:
            _fail(
                "--csv with --vocab-parallel: torch's CSV has no E/S/T/G passes; write it "
                "without --vocab-parallel (a csv: schedule trained with model.vocab_parallel = "
                "true gets its passes placed when the run starts)"
            )
        if show_all and merge_w > 1:
            _fail("--merge-w shows one schedule, not --all")
        if show_all:
            click.echo(compare(pp, microbatches, v, early_grad_send, vocab=vocab_parallel))
            return
        click.echo(
            describe(
                spec,
                pp,
                microbatches,
                v,
                early_grad_send,
                grid=grid,
                vocab=vocab_parallel,
                merge_w=merge_w,
            )  # fmt: skip
        )
        if csv_path:
            shown = make_schedule(
                name, pp, microbatches, v, early_grad_send, csv=copy, merge_w=merge_w
            )
            actions = shown.lists()
            unit = simulate(actions, shown.placement, unit_costs(actions))
            text = dump_csv(actions, unit.start)
            with open(csv_path, "w", newline="") as fh:
                fh.write(text)
            click.echo(f"wrote {csv_path} (torch's compute-only CSV, a row per pp rank)")
    except ScheduleError as exc:
        _fail(str(exc).splitlines()[0])
    except OSError as exc:
        _fail(f"--csv {csv_path}: {exc.strerror}")


schedule.add_command(schedule_search)


# schedule show simulates in Python at about 20 us per action: these bound it to seconds
SHOW_LIMITS = {"--pp": 256, "--microbatches": 4096, "--virtual": 16}
SHOW_CELLS = 25_000  # pp x microbatches x virtual


def _check_schedule_size(pp: int, microbatches: int, v: int) -> None:
    for option, value in (("--pp", pp), ("--microbatches", microbatches), ("--virtual", v)):
        if not 1 <= value <= SHOW_LIMITS[option]:
            _fail(f"{option} {value}: must be between 1 and {SHOW_LIMITS[option]}")
    if pp * microbatches * v > SHOW_CELLS:
        _fail(
            f"pp({pp}) x microbatches({microbatches}) x virtual({v}) = {pp * microbatches * v:,}"
            f" > {SHOW_CELLS:,}: too big to simulate here in seconds; choose a smaller grid"
        )
