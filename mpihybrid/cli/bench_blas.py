"""`mpihybrid bench blas [JOB]`: which OpenBLAS kernel set runs this job's matmuls fastest here.

    mpihybrid bench blas jobs/gpt_bench.toml            # measure, print the table
    mpihybrid bench blas jobs/gpt_bench.toml --save     # ... and let every run use the fastest

OpenBLAS picks its kernels once, when it loads, from OPENBLAS_CORETYPE or the CPU it finds, so
each kernel set is timed in fresh processes: `--ranks` of them at once (default: one per core,
as training runs, every core busy), each timing one pass over the job's GEMMs (the shapes its
layers declare, Layer.cost: the roofline's list) `--repeats` times. The kernel sets take turns
round after round, so a change in the machine's load falls on all alike; a set's time is the
least over rounds of its slowest process (another process can only slow a round: a noisy
round must not choose the kernels). `--save` writes the winner to the cache that
mpihybrid/_blas.py reads before numpy loads (OpenBLAS's own pick wins ties within 1 %).
Measured once per machine; results depend on the kernels (the bits of a run change with them).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import click

from mpihybrid._blas import (
    CORE_VAR,
    ENV,
    cache_path,
    candidates,
    cpu_info,
    machine_key,
    openblas_path,
)
from mpihybrid.cli.options import set_option
from mpihybrid.units import table

DEFAULT = "default"  # OpenBLAS's own pick: OPENBLAS_CORETYPE unset
TIE = 0.01  # a kernel set must beat OpenBLAS's own pick by this much to be chosen


def openblas_core() -> str:
    """The kernel set numpy's OpenBLAS runs in this process ("" if numpy's BLAS is another)."""
    import numpy as np  # noqa: F401  (loads the library: the CDLL below is the same handle)

    path = openblas_path()
    if not path:
        return ""
    lib = ctypes.CDLL(path)
    for symbol in (
        "scipy_openblas_get_corename64_",
        "scipy_openblas_get_corename",
        "openblas_get_corename64_",
        "openblas_get_corename",
    ):
        fn = getattr(lib, symbol, None)
        if fn is not None:
            fn.restype = ctypes.c_char_p
            return fn().decode()
    return ""


def gemm_pass_seconds(gemms, repeats: int) -> float:
    """Median seconds of one pass over `gemms` (b, m, k, n), each on operands of its own."""
    import numpy as np

    rng = np.random.default_rng(0)
    operands = [
        (
            rng.standard_normal((b, m, k), np.float32),
            rng.standard_normal((b, k, n), np.float32),
            np.empty((b, m, n), np.float32),
        )
        for b, m, k, n in gemms
    ]
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for a, w, out in operands:
            np.matmul(a, w, out=out)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def probe(gemms: list[list[int]], repeats: int) -> dict:
    """This process's kernel set and the median seconds of one pass over `gemms`."""
    return {"core": openblas_core(), "seconds": gemm_pass_seconds(gemms, repeats)}


def _environ(core: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != CORE_VAR}
    env.update({ENV: "off", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    if core != DEFAULT:
        env[CORE_VAR] = core
    return env


def time_core(core: str, gemms: list, ranks: int, repeats: int) -> dict | None:
    """`ranks` fresh processes at once under kernel set `core`: the slowest one's time, or None
    when the set does not run here (a process failed: an instruction the CPU lacks)."""
    code = (
        "import json,sys; from mpihybrid.cli.bench_blas import probe; "
        "print(json.dumps(probe(json.loads(sys.argv[1]), int(sys.argv[2]))))"
    )
    cmd = [sys.executable, "-c", code, json.dumps(gemms), str(repeats)]
    procs = [
        subprocess.Popen(cmd, env=_environ(core), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(ranks)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            return None
        results.append(json.loads(out))
    return {"core": results[0]["core"], "seconds": max(r["seconds"] for r in results)}


def measure(gemms: list, ranks: int, repeats: int, rounds: int, echo=None) -> list[dict]:
    """Every kernel set this CPU can run, in turns over `rounds`: rows sorted fastest first."""
    _, flags = cpu_info()
    names = [DEFAULT, *candidates(flags)]
    seen: dict[str, list[float]] = {n: [] for n in names}
    kernels: dict[str, str] = {}
    for r in range(rounds):
        for name in list(seen):
            got = time_core(name, gemms, ranks, repeats)
            if got is None:
                del seen[name]
                continue
            seen[name].append(got["seconds"])
            kernels[name] = got["core"]
        if echo:
            echo(f"[{r + 1}/{rounds}] round done")
    from mpihybrid.nn.cost import gemm_flops  # numpy loads here, after every probe

    flops = gemm_flops(gemms)
    rows = []
    for name, times in seen.items():
        if name != DEFAULT and kernels[name] == kernels.get(DEFAULT):
            continue  # the same kernels as OpenBLAS's own pick
        t = min(times)
        gflops = flops / t / 1e9
        rows.append({"name": name, "kernels": kernels[name], "seconds": t, "gflops": gflops})
    base = next((row["seconds"] for row in rows if row["name"] == DEFAULT), None)
    for row in rows:
        row["speedup"] = base / row["seconds"] if base else None
    return sorted(rows, key=lambda row: row["seconds"])


def best(rows: list[dict]) -> str:
    """The fastest set, unless OpenBLAS's own pick is within TIE of it."""
    default = next((r for r in rows if r["name"] == DEFAULT), None)
    if default is None or rows[0]["seconds"] < default["seconds"] * (1 - TIE):
        return rows[0]["name"]
    return DEFAULT


def save(choice: str, rows: list[dict], job: str) -> str:
    from mpihybrid.files import write_atomic

    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "machine": machine_key(),
        "core": None if choice == DEFAULT else choice,
        "measured": rows,
        "job": job,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_atomic(path, json.dumps(data, indent=2) + "\n", overwrite=True)
    return str(path)


def format_rows(rows: list[dict], choice: str, ranks: int) -> str:
    cells = [
        [
            r["name"],
            r["kernels"],
            f"{r['gflops']:.1f}",
            f"{r['speedup']:.3f}x" if r["speedup"] else "-",
            "<- fastest" if r["name"] == choice else "",
        ]
        for r in rows
    ]
    header = ["kernel set", "runs", "GFLOP/s per process", "vs own pick", ""]
    lines = table(header, cells, labels=2, left=(4,))
    lines.append(f"({ranks} processes at once, one BLAS thread each; the slowest counts)")
    return "\n".join(lines)


def _job(job_file: str | None, overrides: list[str], ranks: int):
    """The job as a run of it would resolve it; grid.dp = -1 (the world's size) as `ranks`."""
    from mpihybrid.config import ConfigError, build_job, load_job, load_table

    try:
        path = job_file or None
        grid = build_job(load_table(path), overrides).grid
        dp = grid.dp if grid.dp != -1 else max(1, ranks // max(grid.pp, 1))
        return load_job(path, overrides, max(grid.pp, 1) * dp)
    except ConfigError as exc:
        click.echo(f"mpihybrid: error: {exc}", err=True)
        sys.exit(2)


@click.command("blas")
@click.argument("job_file", required=False, type=click.Path(dir_okay=False))
@set_option("model.hidden=1024")
@click.option(
    "--ranks",
    type=click.IntRange(1, 1024),
    default=None,
    help="Processes timed at once (default: the machine's cores).",
)
@click.option("--repeats", type=click.IntRange(1, 1000), default=5, show_default=True)
@click.option("--rounds", type=click.IntRange(1, 100), default=5, show_default=True)
@click.option(
    "--save",
    "do_save",
    is_flag=True,
    help="Write the fastest to the cache every mpihybrid run reads.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def bench_blas(*, job_file, overrides, ranks, repeats, rounds, do_save, as_json) -> None:
    """Time JOB_FILE's matmuls under each OpenBLAS kernel set; --save keeps the fastest."""
    from mpihybrid.nn.cost import model_gemms

    if not openblas_path():
        click.echo(
            "mpihybrid: error: numpy's BLAS is not OpenBLAS: no kernel set to choose", err=True
        )
        sys.exit(2)
    ranks = ranks or os.cpu_count() or 1
    gemms = [list(g) for g in model_gemms(_job(job_file, list(overrides), ranks).workload)]
    echo = None if as_json else (lambda text: click.echo(text, err=True))
    rows = measure(gemms, ranks, repeats, rounds, echo)
    choice = best(rows)
    path = save(choice, rows, job_file or "(default job)") if do_save else None
    if as_json:
        click.echo(json.dumps({"rows": rows, "fastest": choice, "saved": path}, indent=2))
        return
    click.echo(format_rows(rows, choice, ranks))
    if path:
        click.echo(
            f"wrote {path}: every mpihybrid run on this machine now uses {choice!r} "
            f"(unless {CORE_VAR} or {ENV} is set)"
        )
    else:
        click.echo("(--save to use the fastest in every run)")
