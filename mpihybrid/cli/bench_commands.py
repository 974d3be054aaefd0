"""`mpihybrid bench allreduce | codecs | train | blas`: benchmarks that print figures.

mpiexec -n 4 mpihybrid bench allreduce
mpiexec -n 2 mpihybrid bench train jobs/gpt_bench.toml
"""

from __future__ import annotations

import json

import click

from mpihybrid.cli.bench_blas import bench_blas
from mpihybrid.cli.commands import (
    MAX_REPEATS,
    MAX_SIZES,
    MAX_STEPS,
    _debug_env,
    _fail,
    abort_job,
    exit_stopped,
)
from mpihybrid.cli.options import set_option
from mpihybrid.cli.resolve import resolve_job


@click.group()
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
def bench_allreduce(*, sizes, codecs, repeats, segment_kb, transport, quiet, as_json) -> None:
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
        check_memory(
            f"--sizes up to {max(size_list):,} bytes on {on_node} ranks", needed, mem_available()
        )
    except ValueError as exc:
        _fail(str(exc), rank)
    from mpihybrid.cli.progress import progress_echo

    progress = progress_echo(rank, quiet)
    rows = run(
        MPI.COMM_WORLD,
        size_list,
        codec_list,
        repeats=repeats,
        progress=progress,
        transport=transport,
        **segment,
    )
    if MPI.COMM_WORLD.rank == 0:
        if as_json:
            import json

            doc = {
                "ranks": MPI.COMM_WORLD.size,
                "repeats": repeats,
                "transport": transport,
                "rows": rows,
            }
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

        doc = {
            "size_bytes": nbytes // 4 * 4,
            "repeats": repeats,
            "fast": _numba.describe(),
            "unit": "GB/s of float32 per CPU second of one core",
            "rows": rows,
        }
        click.echo(json.dumps(doc, indent=2))
    elif rank == 0:
        click.echo(
            f"codecs on {human_bytes(nbytes // 4 * 4, 1)} of float32, median of {repeats}; "
            f"GB/s = float32 bytes / CPU time of one core; fast = {_numba.describe()}"
        )
        click.echo(format_codec_table(rows))


def _cpu_only(job) -> None:
    from mpihybrid.config import ConfigError

    if job.grid.device != "cpu":
        raise ConfigError(
            f"grid.device = {job.grid.device!r}: bench train measures the CPU's matmul "
            "roofline; use grid.device = 'cpu' (or mpihybrid train for a GPU run)"
        )


@bench.command("train")
@click.argument("job_file", required=False, type=click.Path(dir_okay=False))
@set_option("train.schedule=1f1b")
@click.option("--warmup", type=click.IntRange(0, MAX_STEPS), default=3, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(1, MAX_STEPS),
    default=10,
    show_default=True,
    help="Measured steps per repeat.",
)
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
def bench_train(*, job_file, overrides, warmup, steps, repeats, against, as_json, quiet) -> None:
    """Training throughput of JOB_FILE: tokens/s, busy fractions, FLOPs, roofline, memory."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    # collective, the one resolution (cli/resolve); a benchmark resumes nothing
    job = resolve_job(job_file, list(overrides), world, resumed=False, check=_cpu_only)[0]
    other = None
    if against:
        more = [*overrides, *against]
        other = (
            resolve_job(job_file, more, world, resumed=False, check=_cpu_only)[0],
            list(against),
        )
    from mpihybrid.cli.bench_train import bench_train as run
    from mpihybrid.cli.bench_train import format_bench
    from mpihybrid.cli.progress import progress_echo
    from mpihybrid.train.loop import StopRequested

    try:
        result = run(
            job,
            world,
            warmup,
            steps,
            repeats,
            against=other,
            progress=progress_echo(world.rank, quiet),
        )
    except StopRequested as exc:
        exit_stopped(world, exc)
    except BaseException as exc:
        abort_job(world, exc, "benchmark", _debug_env())
    if result is not None:
        click.echo(json.dumps(result, indent=2) if as_json else format_bench(result))
