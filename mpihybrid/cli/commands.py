"""The `mpihybrid` command: parse, call, print.

mpiexec -n 4 mpihybrid train                                  # embedded default job
mpiexec -n 12 mpihybrid train jobs/seed_k3_d4.toml --trace runs/seed.h5
mpihybrid schedule show --schedule 1f1b --pp 4 --microbatches 8
mpiexec -n 4 mpihybrid bench allreduce
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

import click

from mpihybrid.cli.bench_blas import bench_blas  # click and the standard library only
from mpihybrid.cli.schedule_search import schedule_search  # click alone at import
from mpihybrid.comm.agree import first_error
from mpihybrid.files import release_all
from mpihybrid.pipeline.schedules import SCHEDULES  # pure Python: --help stays fast
from mpihybrid.pipeline.simulate import GRID_RANKS, GRID_ROWS

EXIT_FAILED = 1  # the run stopped (nan, a refused checkpoint) or a rank failed (job aborted)
EXIT_USAGE = 2
EXIT_PREEMPTED = 3  # a signal asked the job to stop; a checkpoint was written (requeue me)
# bounds of the bench commands' counts and sizes (a typo must not start a day-long run)
MAX_REPEATS = 10_000
MAX_STEPS = 100_000
MAX_SIZES = 64  # bench allreduce --sizes (each size: what the node's memory holds)
ABORT_DRAIN_S = 0.25  # abort_job: time for the launcher to forward the rank's last line
DEBUG_ENV = "MPIHYBRID_DEBUG"  # set (not 0): a failing rank prints its full traceback


def _fail(message: str, rank: int = 0) -> None:
    """One line on stderr (from rank 0 only, under mpiexec) and exit 2 everywhere."""
    if rank == 0:
        click.echo(f"mpihybrid: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def _launcher_rank() -> int:
    """This process's rank as the MPI launcher told it (0 outside a launch), without MPI_Init."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class LazyGroup(click.Group):
    """Commands living in other modules load on first use (keeps `--help` and `train` fast)."""

    lazy = {
        "analyze": "mpihybrid.cli.trace:analyze",
        "timeline": "mpihybrid.cli.trace:timeline",
        "export": "mpihybrid.cli.trace:export",
        "compare": "mpihybrid.cli.trace:compare",
        "sweep": "mpihybrid.cli.sweep:sweep",
        "predict": "mpihybrid.cli.predict:predict",
        "data": "mpihybrid.cli.text:data",
        "generate": "mpihybrid.cli.text:generate",
        "weights": "mpihybrid.cli.weights:weights",
        "why": "mpihybrid.cli.why:why",
    }

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Under mpiexec every rank parses the same command line: only rank 0 shows a usage
        error (all exit 2)."""
        try:  # MPIHYBRID_KERNELS is read when the kernels' switch is imported: a bad value
            from mpihybrid import _numba  # noqa: F401  (or numba asked for, not there) is usage
        except ImportError as exc:
            _fail(str(exc), _launcher_rank())
        if not standalone_mode or _launcher_rank() == 0:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            return super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            sys.exit(1)

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, attr = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mpihybrid")
def main() -> None:
    """Hybrid pipeline + data-parallel training over MPI, traced to HDF5."""


@main.command()
@click.argument("job_file", required=False)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override one job setting (repeatable), e.g. --set train.steps=20.",
)
@click.option("--trace", "trace_path", metavar="PATH", help="Write the run's HDF5 trace here.")
@click.option("--overwrite", is_flag=True, help="Replace an existing trace file.")
@click.option(
    "--quiet", is_flag=True, help="No per-step progress lines (resumes and warnings still show)."
)
@click.option(
    "--resume",
    is_flag=True,
    help="Require a checkpoint in checkpoint.dir to continue from (a run resumes from "
    "the newest intact one there anyway).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Resume from checkpoint.dir even when its job differs from this one in more than the "
    "settings a resume may change (the refusal names them).",
)
@click.option(
    "--debug",
    is_flag=True,
    help=f"On a failure, print the full traceback, not one line (also {DEBUG_ENV}=1).",
)
def train(job_file, overrides, trace_path, overwrite, quiet, resume, force, debug) -> None:
    """Train JOB_FILE (TOML; the embedded default job when omitted) on every rank of mpiexec.

    Ctrl-C (or SIGINT to mpiexec) stops every rank at the next step boundary, trace written,
    exit 130 (twice: at once); SIGUSR1/SIGTERM checkpoint there and exit 3. A rank that makes
    no progress for comm.timeout_s ends the job saying what it waits on (`mpihybrid why`)."""
    from mpihybrid.train.watchdog import StopSignals

    StopSignals.install()  # before MPI starts: no moment of the run takes a signal's default
    from mpi4py import MPI

    from mpihybrid.config import ConfigError, load_job
    from mpihybrid.trace.read import TraceError
    from mpihybrid.train.checkpoint import CheckpointError
    from mpihybrid.train.memory import check_fits
    from mpihybrid.train.resume import batch_given, keep_recorded_batch

    world = MPI.COMM_WORLD
    _setup_logging(world.rank, quiet)
    overrides = list(overrides)
    if trace_path is not None:
        overrides.append(f"trace.path={_quote(trace_path)}")
    if overwrite:
        overrides.append("trace.overwrite=true")
    # Every rank validates the same inputs; rank 0 also checks the file system. All ranks then
    # agree on the first error, so they exit together before any message of training is sent.
    error, job, resume_from = None, None, None
    try:
        job = load_job(job_file, overrides, world.Get_size())
    except ConfigError as exc:
        error = str(exc)
    exit_on_any_error(world, error)
    try:  # collective: a resume at another dp keeps the checkpoint's default global batch
        job = keep_recorded_batch(job, world, batch_given(job_file, overrides))
    except ConfigError as exc:
        error = str(exc)
    exit_on_any_error(world, error)
    job = _timed_partition(_auto_schedule(job, world), world)  # collective: before checkpoints
    job, order_choice = _auto_order(job, world)  # collective
    try:
        if world.rank == 0:
            resume_from = _preflight(job, resume, force)
    except (ConfigError, CheckpointError, TraceError) as exc:
        error = str(exc)
    except FileExistsError as exc:
        error = f"{exc} (--overwrite replaces it)"
    except OSError as exc:
        error = str(exc)
    except Exception as exc:  # rank 0 alone, while the others wait below: end them all
        abort_job(world, exc, "checking the job", debug or _debug_env())
    exit_on_any_error(world, error)
    try:
        check_fits(job, world)  # collective: the same verdict on every rank
    except ConfigError as exc:
        exit_on_any_error(world, str(exc))
    resume_from = world.bcast(resume_from, root=0)
    notes = {"order_choice": order_choice} if order_choice else None
    summary = _run_training(job, world, quiet, resume_from, debug or _debug_env(), notes)
    release_all()  # rank 0's locks on checkpoint.dir and the trace (exit drops them too)
    if summary is not None:
        from mpihybrid.train.report import format_report

        click.echo(format_report(job, summary))


def _auto_schedule(job, world):
    """train.schedule = "auto" searched on rank 0 and the same schedule and split given to
    every rank (cli/auto.py); bad costs or a limit no schedule meets: one line, exit 2 on
    every rank. Any other schedule as it is."""
    from mpihybrid.cli.auto import resolve_auto
    from mpihybrid.config import AUTO, ConfigError

    if job.train.schedule != AUTO:
        return job
    try:
        return resolve_auto(job, world)
    except ConfigError as exc:  # the same on every rank (rank 0's, broadcast)
        exit_on_any_error(world, str(exc))
    except Exception as exc:  # rank 0 alone, while the others wait in bcast: end them all
        abort_job(world, exc, "searching the schedule", _debug_env())


def _timed_partition(job, world):
    """model.partition = "timed" fixed as rank 0 measures it (or as the checkpoint to resume
    was split), the same on every rank; any other partition as it is."""
    from mpihybrid.train.partition import resolve_partition

    if job.model.partition != "timed":
        return job
    counts = None
    if world.rank == 0:
        try:
            counts = resolve_partition(job).model.partition
        except Exception as exc:  # rank 0 alone, while the others wait in bcast: end them all
            abort_job(world, exc, "timing the model's blocks", _debug_env())
    counts = world.bcast(counts, root=0)
    logging.getLogger("mpihybrid").info(
        "model.partition = 'timed': %s layers per chunk (embedding with the first, head with "
        "the last)",
        counts,
    )
    return dataclasses.replace(job, model=dataclasses.replace(job.model, partition=counts))


def _auto_order(job, world):
    """grid.order = "auto" chosen (predict.auto; collective), said by rank 0 in one line: (the
    job, the line); any other order: (the job, "")."""
    from mpihybrid.predict.auto import resolve_order

    job, line = resolve_order(job, world)
    if line and world.rank == 0:
        click.echo(f"mpihybrid: {line}", err=True)
    return job, line


def _run_training(job, world, quiet: bool, resume_from, debug: bool, notes=None):
    """train() with every way it can end mapped to one line and an exit code: 3 preempted,
    130 interrupted, 143 terminated, 2 a checkpoint or device refused before training, 1 a run
    that stopped (all ranks agreed) or a rank that failed alone (then the whole job is aborted:
    an exception, but also a KeyboardInterrupt or a SystemExit on one rank)."""
    from mpihybrid.comm.device import DeviceError
    from mpihybrid.train.checkpoint import CheckpointError
    from mpihybrid.train.loop import StopRequested
    from mpihybrid.train.loop import train as run_training

    try:
        peak = _calibrated_gemm_flops() if job.grid.device == "cpu" else None
        return run_training(
            job, world, quiet=quiet, resume_from=resume_from, peak_flops=peak, notes=notes
        )
    except StopRequested as exc:  # every rank alike, at a step boundary
        exit_stopped(world, exc)
    except (CheckpointError, DeviceError) as exc:  # on every rank alike, before any training
        if world.rank == 0:
            click.echo(f"mpihybrid: error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except BaseException as exc:
        abort_job(world, exc, "training", debug)


def _calibrated_gemm_flops() -> float | None:
    """One core's GEMM rate from this machine's calibrated cluster file (what `predict
    --calibrate` writes to the user's directory), for the step line's roofline share; None
    when there is none (the installed local.toml was fitted on another machine)."""
    from mpihybrid.predict.cluster import ClusterError, load_cluster, user_dir

    path = user_dir() / "local.toml"
    try:
        return load_cluster(path).device.gemm_flops if path.is_file() else None
    except (ClusterError, OSError):
        return None


def exit_stopped(world, exc) -> NoReturn:
    """Every rank stopped together (train.loop.StopRequested): rank 0 says why, all exit with
    the stop's code (a preemption's line on stdout, where the SLURM log expects it)."""
    if world.rank == 0:
        if exc.exit_code == EXIT_PREEMPTED:
            click.echo(str(exc))
        else:
            failed = exc.exit_code == EXIT_FAILED
            click.echo(f"mpihybrid: {'error: ' if failed else ''}{exc}", err=True)
    sys.exit(exc.exit_code)


def _debug_env() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def abort_job(world, exc: BaseException, what: str, debug: bool) -> NoReturn:
    """One rank failed where the others may wait in a collective: one line on stderr (the rank,
    the step, the error; the full traceback with --debug or MPIHYBRID_DEBUG=1), MPI_Abort for
    the whole job, then leave at once: MPI_Abort returns under some MPIs (the PyPI MPICH)."""
    step = getattr(exc, "step", None)
    where = f"rank {world.rank}" + (f", step {step}" if step is not None else "")
    if debug:
        sys.stderr.write(traceback.format_exc())
    sys.stderr.write(f"mpihybrid: error: {what} failed on {where}: {_one_line(exc)}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # The launcher forwards a rank's stderr on its own time, and MPI_Abort can end the
    # forwarding before it has read the line (the line was lost once in a loaded test run):
    # give it a moment, on this failure path only.
    time.sleep(ABORT_DRAIN_S)
    try:
        world.Abort(EXIT_FAILED)
    finally:
        os._exit(EXIT_FAILED)


def _one_line(exc: BaseException) -> str:
    """An exception as one line; an MPI error says which rank stopped answering where MPI
    names it (a peer killed by the OS, say)."""
    from mpi4py import MPI

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, MPI.Exception):
        peer = re.search(r"rank (\d+)", text)
        who = f"rank {peer.group(1)}" if peer else "another rank"
        return f"{who} stopped answering (MPI: {text[:200]})"
    if isinstance(exc, MemoryError):
        return f"out of memory ({text})"
    return f"{type(exc).__name__}: {text}"


def exit_on_any_error(world, error: str | None) -> None:
    """Collective: every rank passes its own error (or None). If any rank has one, all exit
    with status 2 together and rank 0 prints the first, so no rank is left waiting."""
    first = first_error(world, error)
    if first is not None:
        if world.rank == 0:
            click.echo(f"mpihybrid: error: {first}", err=True)
        sys.exit(EXIT_USAGE)


def _preflight(job, resume: bool, force: bool = False) -> list[str] | None:
    """Rank 0, before anything is built: create and test-write checkpoint.dir and the trace's
    temporary (exit 2 now, not a lost run later), lock both for this run (files.acquire_lock),
    remove partial checkpoints and temporaries of crashed runs, refuse another job's checkpoint
    or trace, and list the complete checkpoints to resume from, newest first (None: afresh)."""
    from mpihybrid.config import ConfigError
    from mpihybrid.files import acquire_lock, clean_stale_temporaries, probe_dir, probe_file
    from mpihybrid.nn.data import check_data
    from mpihybrid.nn.tokens import DataError
    from mpihybrid.trace.file import check_writable
    from mpihybrid.train import checkpoint

    try:  # token files: header, size, vocabulary, enough windows
        check_data(job)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    root, candidates, manifest = job.checkpoint.dir, [], None
    if root:
        try:
            probe_dir(root)
            acquire_lock(root, f"checkpoint.dir {root}", is_dir=True)
        except OSError as exc:
            raise checkpoint.CheckpointError(f"checkpoint.dir = {root!r}: {exc}") from None
        for stale in checkpoint.clean_partials(root):
            logging.getLogger("mpihybrid").warning("removed %s (a crashed run's partial)", stale)
        candidates = [str(p) for p in reversed(checkpoint.complete(root))]
    if resume and not candidates:
        raise checkpoint.CheckpointError(
            f"--resume: no complete checkpoint in checkpoint.dir = {root!r}"
        )
    if candidates:  # refuse another model now; a damaged one is restore_all's to skip
        newest = Path(candidates[0])
        try:
            manifest = checkpoint.read_manifest(newest)
            checkpoint.check_compatible(manifest, job, newest)
            checkpoint.check_same_job(manifest, job, newest, force)
        except checkpoint.CheckpointDamaged:
            pass
    if job.trace.path:
        # a resumed run continues the trace already at its path: its own, not another run's
        check_writable(job.trace.path, job.trace.overwrite, bool(candidates))
        probe_file(job.trace.path)
        acquire_lock(job.trace.path, f"trace {job.trace.path}")
        clean_stale_temporaries(job.trace.path)
        if candidates and not job.trace.overwrite:
            checkpoint.check_trace_owner(job.trace.path, job)
    return candidates or None


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _setup_logging(rank: int, quiet: bool) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[r{rank}] %(message)s"))
    logger = logging.getLogger("mpihybrid")
    logger.handlers[:] = [handler]
    # --quiet drops the per-step lines (train() asks); a resume or a checkpoint still shows
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


@main.group()
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
def schedule_show(
    name, pp, microbatches, virtual, show_all, early_grad_send, grid, csv_path, trace_path
):
    """Print a schedule's step x rank grid, predicted bubble and peak activations."""
    from mpihybrid.pipeline.csv_schedule import dump_csv, from_trace
    from mpihybrid.pipeline.schedules import ScheduleError, build_schedule, chunks_for, placement_of
    from mpihybrid.pipeline.simulate import compare, describe, simulate, unit_costs

    if show_all and (csv_path or trace_path):
        _fail(f"{'--csv' if csv_path else '--trace'} shows one schedule, not --all")
    if trace_path:
        from mpihybrid.trace.read import TraceError, load

        try:
            attrs = load(trace_path).attrs
        except TraceError as exc:
            _fail(str(exc))
        name, pp, microbatches = from_trace(attrs), int(attrs["pp"]), int(attrs["microbatches"])
        virtual = int(attrs.get("virtual_stages", 1))
        early_grad_send = bool(attrs.get("early_grad_send", False))
    try:
        v = virtual if virtual is not None else (2 if show_all else chunks_for(name))
        _check_schedule_size(pp, microbatches, v)
        if show_all:
            click.echo(compare(pp, microbatches, v, early_grad_send))
            return
        click.echo(describe(name, pp, microbatches, v, early_grad_send, grid))
        if csv_path:
            actions = build_schedule(name, pp, microbatches, v, early_grad_send)
            unit = simulate(actions, placement_of(name, pp, v), unit_costs(actions))
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


@main.group()
def bench() -> None:
    """Benchmarks that print figures (run them under mpiexec)."""


bench.add_command(bench_blas)


@bench.command("allreduce")
@click.option(
    "--sizes",
    default="4K,16K,64K,256K,1M,4M,16M,64M",
    show_default=True,
    help="Message sizes in bytes (K/M suffixes).",
)
@click.option("--codecs", default=None, help="Comma list of codecs (default: every codec).")
@click.option("--repeats", type=click.IntRange(1, MAX_REPEATS), default=5, show_default=True)
@click.option(
    "--segment-kb",
    type=click.IntRange(min=1),
    default=None,
    help="KiB of float32 per ring message (default: comm.segment_kb's default).",
)
@click.option(
    "--transport",
    type=click.Choice(["auto", "mpi"]),
    default="auto",
    show_default=True,
    help="auto: a lossy ring on one node reads its neighbours' shared memory; mpi: messages.",
)
@click.option("--quiet", is_flag=True, help="No progress line per size on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead.")
def bench_allreduce(sizes, codecs, repeats, segment_kb, transport, quiet, as_json) -> None:
    """Hand-written ring vs MPI's own Allreduce: time, algbw, busbw, bytes on the wire."""
    from mpi4py import MPI

    from mpihybrid.cli.bench import bench_allreduce as run
    from mpihybrid.cli.bench import check_memory, format_table, memory_needed, parse_size
    from mpihybrid.comm.codecs import CODECS
    from mpihybrid.comm.device import local_rank
    from mpihybrid.train.memory import mem_available

    rank = MPI.COMM_WORLD.rank
    try:
        size_list = [parse_size(s) for s in sizes.split(",") if s]
    except (ValueError, OverflowError) as exc:
        _fail(f"--sizes {sizes!r}: {exc}", rank)
    small = [s for s in size_list if s < 4]
    if small or not size_list:
        _fail(f"--sizes {sizes!r}: every size must be at least 4 bytes (one float)", rank)
    if len(size_list) > MAX_SIZES:
        _fail(f"--sizes: {len(size_list)} sizes; at most {MAX_SIZES}", rank)
    codec_list = [c for c in codecs.split(",") if c] if codecs else list(CODECS)
    unknown = [c for c in codec_list if c not in CODECS]
    if unknown:
        _fail(f"unknown codec {unknown[0]!r}; choose from {', '.join(CODECS)}", rank)
    segment = {} if segment_kb is None else {"segment": 256 * segment_kb}
    _, on_node = local_rank(MPI.COMM_WORLD)
    needed = memory_needed("allreduce", max(size_list), len(codec_list), on_node)
    try:  # every rank reads the same node's figure: all agree
        check_memory(f"--sizes up to {max(size_list):,} bytes on {on_node} ranks", needed,
                     mem_available())  # fmt: skip
    except ValueError as exc:
        _fail(str(exc), rank)
    from mpihybrid.cli.progress import progress_echo

    progress = progress_echo(rank, quiet)
    rows = run(
        MPI.COMM_WORLD, size_list, codec_list, repeats=repeats, progress=progress,
        transport=transport, **segment,
    )  # fmt: skip
    if MPI.COMM_WORLD.rank == 0:
        if as_json:
            import json

            doc = {"ranks": MPI.COMM_WORLD.size, "repeats": repeats, "transport": transport,
                   "rows": rows}  # fmt: skip
            click.echo(json.dumps(doc, indent=2))
        else:
            click.echo(format_table(rows))


@bench.command("codecs")
@click.option("--size", default="16M", show_default=True, help="float32 bytes (K/M/G suffixes).")
@click.option("--codecs", default=None, help="Comma list of codecs (default: every codec).")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead.")
def bench_codecs(size, codecs, repeats, as_json) -> None:
    """GB/s per core of each codec operation: numba kernels beside the numpy references."""
    from mpi4py import MPI

    from mpihybrid import _numba
    from mpihybrid.cli.bench import bench_codecs as run
    from mpihybrid.cli.bench import check_memory, format_codec_table, memory_needed, parse_size
    from mpihybrid.comm.codecs import CODECS
    from mpihybrid.comm.device import local_rank
    from mpihybrid.train.memory import mem_available
    from mpihybrid.units import human_bytes

    rank = MPI.COMM_WORLD.rank
    try:
        nbytes = parse_size(size)
    except ValueError as exc:
        _fail(str(exc), rank)
    if nbytes < 4:
        _fail(f"--size {size}: needs at least 4 bytes (one float32)", rank)
    if repeats < 1:
        _fail(f"--repeats {repeats}: needs at least 1", rank)
    codec_list = [c for c in codecs.split(",") if c] if codecs else list(CODECS)
    unknown = [c for c in codec_list if c not in CODECS]
    if unknown:
        _fail(f"unknown codec {unknown[0]!r}; choose from {', '.join(CODECS)}", rank)
    _, on_node = local_rank(MPI.COMM_WORLD)
    try:
        needed = memory_needed("codecs", nbytes, len(codec_list)) * on_node
        check_memory(f"--size {size} on {on_node} ranks", needed, mem_available())
    except ValueError as exc:
        _fail(str(exc), rank)
    rows = run(nbytes, codec_list, repeats=repeats)
    if rank == 0 and as_json:
        import json

        doc = {"size_bytes": nbytes // 4 * 4, "repeats": repeats, "fast": _numba.describe(),
               "unit": "GB/s of float32 per CPU second of one core", "rows": rows}  # fmt: skip
        click.echo(json.dumps(doc, indent=2))
    elif rank == 0:
        click.echo(
            f"codecs on {human_bytes(nbytes // 4 * 4, 1)} of float32, median of {repeats}; "
            f"GB/s = float32 bytes / CPU time of one core; fast = {_numba.describe()}"
        )
        click.echo(format_codec_table(rows))


@bench.command("train")
@click.argument("job_file", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override one job setting (repeatable), e.g. --set train.schedule=1f1b.",
)
@click.option("--warmup", type=click.IntRange(0, MAX_STEPS), default=3, show_default=True)
@click.option("--steps", type=click.IntRange(1, MAX_STEPS), default=10, show_default=True,
              help="Measured steps per repeat.")  # fmt: skip
@click.option("--repeats", type=click.IntRange(1, MAX_REPEATS), default=3, show_default=True)
@click.option(
    "--against",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Also run the job with this override (repeatable) beside each repeat (after it, then "
    "before the next: ABBA), and print the throughput ratio repeat by repeat.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--quiet", is_flag=True, help="No progress line per repeat on stderr.")
def bench_train(job_file, overrides, warmup, steps, repeats, against, as_json, quiet) -> None:
    """Training throughput of JOB_FILE: tokens/s, busy fractions, FLOPs, roofline, memory."""
    from mpi4py import MPI

    from mpihybrid.config import ConfigError, load_job

    world = MPI.COMM_WORLD
    error, job, other = None, None, None
    try:
        job = load_job(job_file, list(overrides), world.Get_size())
        if against:
            other = (load_job(job_file, [*overrides, *against], world.Get_size()), list(against))
        for device in {job.grid.device, other[0].grid.device if other else "cpu"} - {"cpu"}:
            raise ConfigError(
                f"grid.device = {device!r}: bench train measures the CPU's matmul "
                "roofline; use grid.device = 'cpu' (or mpihybrid train for a GPU run)"
            )
    except ConfigError as exc:
        error = str(exc)
    exit_on_any_error(world, error)
    job = _auto_order(_timed_partition(_auto_schedule(job, world), world), world)[0]
    if other is not None:
        other = (
            _auto_order(_timed_partition(_auto_schedule(other[0], world), world), world)[0],
            other[1],
        )
    from mpihybrid.cli.bench_train import bench_train as run
    from mpihybrid.cli.bench_train import format_bench
    from mpihybrid.cli.progress import progress_echo
    from mpihybrid.train.loop import StopRequested

    try:
        result = run(job, world, warmup, steps, repeats, other, progress_echo(world.rank, quiet))
    except StopRequested as exc:
        exit_stopped(world, exc)
    except BaseException as exc:
        abort_job(world, exc, "benchmark", _debug_env())
    if result is not None:
        click.echo(json.dumps(result, indent=2) if as_json else format_bench(result))


if __name__ == "__main__":  # pragma: no cover
    main()
