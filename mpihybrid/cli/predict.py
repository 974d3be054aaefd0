"""`mpihybrid predict`: a job's step time, throughput, bubble, exposed communication and memory
on a cluster file, before running it.

    mpihybrid predict jobs/a100_gpt.toml --cluster a100_80gb     # a packaged cluster, by name
    mpihybrid predict jobs/bench_pp2.toml --set train.schedule=zb-h1 --json
    mpihybrid predict jobs/gpt_bench.toml --calibrate runs/cal.h5   # fit this machine, say where

Exit status: 0; 2 bad input (one line); 4 the job does not fit the device's memory (one line on
stderr after the prediction, which --json still prints).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from mpihybrid.cli.commands import _fail
from mpihybrid.cli.options import set_option
from mpihybrid.units import human_bytes, table

DEFAULT_CLUSTER = "local"  # the user's calibrated file, else the one packaged (this project's)
EXIT_DOES_NOT_FIT = 4
# no second node here: the link of benchmarks/two_nodes.sh (tc tbf, 2 Gbit/s each way)
_TWONODE = {"alpha_s": 1e-4, "bandwidth": 2.5e8, "node_bandwidth": 2.5e8}


def _load_job(job_file: str, overrides: list[str], search: bool = False):
    from mpihybrid.cli.resolve import resolve_offline

    job = resolve_offline(job_file, overrides, timed=not search)
    if job.model.partition == "timed":  # --search: left unmeasured
        raise ValueError(
            "model.partition = 'timed' times one layout and --search varies them: "
            "search with 'cost', then time the layout chosen"
        )
    return job


def _calibrate(trace_path: str, cluster_name: str, out: str | None, echo) -> Path:
    """Fit this machine to the trace, write the cluster file (`out`, replacing what is there;
    by default a new file in the user's directory), print every figure and the path; the path.
    The network figures (no second node to measure) come from the --cluster file."""
    from mpihybrid.predict.calibrate import calibrate
    from mpihybrid.predict.cluster import (
        ClusterError,
        Link,
        cluster_toml,
        load_cluster,
        user_dir,
        write_cluster,
    )
    from mpihybrid.trace.read import load

    path = Path(out) if out else user_dir() / "local.toml"
    if out is None and path.exists():
        raise ValueError(
            f"{path} exists (an earlier calibration): give --cluster-out PATH to "
            "replace it or to write another file"
        )
    try:
        network = load_cluster(cluster_name).links["network"]
    except ClusterError:
        network = Link(**_TWONODE)
    cluster, notes = calibrate(load(trace_path), network)
    notes.update({f"links.network.{k}": "kept: no second node to measure" for k in _TWONODE})
    header = (
        f"This machine, fitted by: mpihybrid predict JOB --calibrate {trace_path}\n"
        "Times drift by +-20% minute to minute on a shared 2-core machine: calibrate and\n"
        "compare in one sitting."
    )
    try:
        write_cluster(path, cluster, header, notes, overwrite=out is not None)
    except FileExistsError:
        raise ValueError(f"{path} exists: give --cluster-out PATH to replace it") from None
    echo("== calibrate: the fitted figures (each with where it came from)")
    section = ""
    for line in cluster_toml(cluster, notes).splitlines():
        if line.startswith("["):
            section = line.strip("[]") + "."
        elif line and not line.startswith("name"):
            echo(f"  {section}{line}")
    echo(f"wrote {path} (use it with --cluster {path})")
    return path


def format_prediction(r: dict) -> str:
    j, unit = r["job"], r["unit"]
    lines = [
        f"== predict: {j['model']}, pp={j['pp']} x dp={j['dp']} ({j['order']}), {j['schedule']}, "
        f"M={j['microbatches']}, codec {j['codec']}"
        + (f" ({j['ring']} ring)" if j.get("ring") == "hierarchical" else "")
        + (f", pipeline wire {j['p2p_codec']}" if j.get("p2p_codec", "fp32") != "fp32" else "")
        + f", on {r['cluster']}",
        f"step time      {1e3 * r['step_time_s']:.2f} ms (pipeline {1e3 * r['pipeline_s']:.2f} ms)",
        f"throughput     {r['throughput']:,.0f} {unit}/s",
        f"bubble         {r['bubble']:.3f}",
        f"exposed comm   {1e3 * r['exposed_comm_s']:.2f} ms (ring time past the last compute)",
        f"efficiency     {100 * r['efficiency']:.1f}% of the device's GEMM rate",
        f"message        {1e3 * r['message_s']:.3f} ms per pipeline hop",
    ]
    seconds = ("forward_s", "backward_s", "weight_s", "allreduce_s", "optimizer_s")
    stages = [
        [s["stage"], f"{s['params']:,}", *(f"{1e3 * s[k]:.2f}" for k in seconds)]
        for s in r["stages"]
    ]
    header = ["stage", "params", "F ms", "B ms", "W ms", "ring ms", "opt ms"]
    lines += table(header, stages, labels=0)
    tied = ", tied embedding" if j.get("tie_embeddings") else ""
    lines.append(f"memory per rank (state = parameters, gradients, optimizer, residual{tied}):")
    for m in r["memory"]:
        lines.append(
            f"  rank {m['rank']}: {human_bytes(m['total_bytes'])} = state "
            f"{human_bytes(m['state_bytes'])} + activations {human_bytes(m['activation_bytes'])}"
            f" + buffers {human_bytes(m['buffer_bytes'])} + data {human_bytes(m['data_bytes'])}"
            f" + temporaries {human_bytes(m['temporary_bytes'])} + runtime "
            f"{human_bytes(m['base_bytes'])}" + ("" if m["fits"] else "  DOES NOT FIT")
        )
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


@click.command()
@click.argument("job_file")
@set_option("train.schedule=zb-h1")
@click.option(
    "--cluster",
    "cluster_path",
    default=DEFAULT_CLUSTER,
    show_default=True,
    metavar="NAME|FILE",
    help="The cluster to predict on: a file, or a name "
    "(a100_80gb, a100_40gb; local: your calibrated file, else the packaged "
    "one).",
)
@click.option(
    "--calibrate",
    "trace_path",
    metavar="TRACE.h5",
    help="Fit this machine to a trace of a real run, print the figures and the file "
    "written, then predict on it.",
)
@click.option(
    "--cluster-out",
    metavar="FILE",
    help="Where --calibrate writes (replacing the "
    "file); default: a new ~/.config/mpihybrid/clusters/local.toml.",
)
@click.option(
    "--search",
    is_flag=True,
    help="Rank every layout of the job for its world size "
    "(pp x dp, grid.order, schedule, M, codec, comm.bucket_kb) that fits, best "
    "first.",
)
@click.option(
    "--world", type=int, metavar="N", help="--search: the world size (default: the job's pp x dp)."
)
@click.option(
    "--top",
    type=int,
    default=15,
    show_default=True,
    metavar="N",
    help="--search: rows printed (--json gives every layout).",
)
@click.option(
    "--ranks-per-node",
    type=int,
    metavar="N",
    help="Ranks placed on one node "
    "(default: the cluster's node.ranks_per_node), e.g. 4 for `mpiexec -n 4` on one "
    "machine.",
)
@click.option("--json", "as_json", is_flag=True, help="Every figure as JSON.")
def predict(
    *,
    job_file,
    overrides,
    cluster_path,
    trace_path,
    cluster_out,
    search,
    world,
    top,
    ranks_per_node,
    as_json,
) -> None:
    """Predict JOB_FILE's step time, throughput, bubble, exposed communication and memory.

    Exit 4 (after the prediction) when a rank does not fit the device's memory; with --search,
    when no layout fits."""
    from mpihybrid.config import AUTO, ConfigError
    from mpihybrid.pipeline.schedules import ScheduleError
    from mpihybrid.predict.cluster import ClusterError, find_cluster, load_cluster
    from mpihybrid.predict.model import predict as run_prediction
    from mpihybrid.predict.search import SearchError
    from mpihybrid.trace.read import TraceError

    # with --json the calibration's lines go to stderr: stdout stays one JSON document
    echo = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    try:
        if world is not None and world < 1:  # 0 read as "not given" would search the job's
            raise ValueError(f"--world {world}: must be >= 1")
        job = _load_job(job_file, list(overrides), search)
        if cluster_out is not None and trace_path is None:
            raise ValueError("--cluster-out is where --calibrate writes: give --calibrate TRACE")
        if trace_path is not None:
            if not Path(trace_path).is_file():
                raise ValueError(f"trace {trace_path!r} does not exist")
            cluster_path = str(_calibrate(trace_path, cluster_path, cluster_out, echo))
        cluster_file = find_cluster(cluster_path)
        cluster = load_cluster(cluster_file)
        if ranks_per_node is not None:
            if ranks_per_node < 1:
                raise ValueError(f"--ranks-per-node {ranks_per_node}: must be >= 1")
            node = dataclasses.replace(cluster.node, ranks_per_node=ranks_per_node)
            cluster = dataclasses.replace(cluster, node=node)
        if search:
            _search(
                job,
                cluster,
                world if world is not None else job.grid.pp * job.grid.dp,
                top,
                as_json,
                job_file=job_file,
            )
            return
        if world is not None:
            raise ValueError("--world is the world size --search ranks layouts for")
        searched = None
        if job.train.schedule == AUTO:
            from mpihybrid.predict.searched import predicted_auto

            job, searched, _ = predicted_auto(job, cluster)
        result = run_prediction(job, cluster)
        if searched:
            result["notes"].append(searched)
    except (
        ConfigError,
        ClusterError,
        ScheduleError,
        SearchError,
        TraceError,
        ValueError,
        OSError,
    ) as exc:
        _fail(str(exc))
    result["cluster_file"] = str(cluster_file)
    click.echo(json.dumps(result, indent=1) if as_json else format_prediction(result))
    exit_if_it_does_not_fit(result)


def exit_if_it_does_not_fit(result: dict) -> None:
    """One line on stderr and exit 4 when a rank needs more than the device's memory."""
    over = [m for m in result["memory"] if not m["fits"]]
    if over:
        worst = max(over, key=lambda m: m["total_bytes"])
        click.echo(
            f"mpihybrid: error: does not fit: rank {worst['rank']} needs "
            f"{human_bytes(worst['total_bytes'])}, the device has "
            f"{human_bytes(result['memory_bytes'])} ({result['cluster']})",
            err=True,
        )
        sys.exit(EXIT_DOES_NOT_FIT)


def _search(job, cluster, world: int, top: int, as_json: bool, *, job_file: str) -> None:
    """Print the ranked layouts (--json: all of them, best first); exit 4 when none fits."""
    from mpihybrid.predict.search import search

    if world < 1 or top < 1:
        raise ValueError(f"--world {world} / --top {top}: must be >= 1")
    ranked, made = search(job, cluster, world)
    if as_json:
        keys = (
            "throughput",
            "step_time_s",
            "bubble",
            "exposed_comm_s",
            "peak_memory_bytes",
            "set",
            "reason",
        )
        click.echo(json.dumps([{k: e[k] for k in keys} for e in ranked], indent=1))
    else:
        click.echo(format_search(ranked, made, world, cluster.name, top, job_file=job_file))
    if not ranked:
        click.echo(
            f"mpihybrid: error: does not fit: none of the {made} layouts on {world} ranks fits "
            f"a device of {human_bytes(cluster.node.memory_bytes)} ({cluster.name})",
            err=True,
        )
        sys.exit(EXIT_DOES_NOT_FIT)


def _prediction_cells(throughput: float, step_s: float, bubble: float, exposed_s: float):
    return [f"{throughput:,.0f}", f"{1e3 * step_s:.2f}", f"{bubble:.3f}", f"{1e3 * exposed_s:.2f}"]


def format_search(
    ranked: list, made: int, world: int, name: str, top: int, *, job_file: str
) -> str:
    if not ranked:
        return f"== search: {made} layouts on {world} ranks, none fits ({name})"
    unit = ranked[0]["prediction"]["unit"]
    lines = [
        f"== search: {made} layouts of {ranked[0]['prediction']['job']['model']} on {world} "
        f"ranks predicted on {name}, {len(ranked)} fit; the best {min(top, len(ranked))}:",
    ]
    rows = []
    for i, e in enumerate(ranked[:top]):
        j = e["prediction"]["job"]
        bucket = next(s.split("=")[1] for s in e["set"] if s.startswith("comm.bucket_kb"))
        prediction = (e["throughput"], e["step_time_s"], e["bubble"], e["exposed_comm_s"])
        rows.append(
            [i + 1, *_prediction_cells(*prediction), human_bytes(e["peak_memory_bytes"])]
            + [f"{j['pp']} x {j['dp']}", j["order"], j["schedule"], j["virtual_stages"]]
            + [j["microbatches"], j["codec"], bucket, e["reason"]]
        )
    header = ["#", f"{unit}/s", "step ms", "bubble", "exp ms", "memory", "pp x dp", "order"]
    header += ["schedule", "v", "M", "codec", "bucket", "reason"]
    lines += table(header, rows, labels=0, left=(6, 7, 8, 11, 13))
    sets = " ".join(f"--set {s}" for s in ranked[0]["set"])
    lines.append(f"run the best: mpiexec -n {world} mpihybrid train {job_file} {sets}")
    return "\n".join(lines)
