"""`mpihybrid predict`: a job's step time, throughput, bubble, exposed communication and memory
on a cluster file, before running it.

    mpihybrid predict jobs/a100_gpt.toml --cluster clusters/a100_80gb.toml
    mpihybrid predict jobs/bench_pp2.toml --set train.schedule=zb-h1 --json
    mpihybrid predict jobs/gpt_bench.toml --calibrate runs/cal.h5   # fit clusters/local.toml
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from mpihybrid.cli.commands import _fail
from mpihybrid.units import human_bytes

DEFAULT_CLUSTER = "clusters/local.toml"
# no second node here: the link of ../shared/tools/twonode.sh (tc tbf, 2 Gbit/s each way)
_TWONODE = {"alpha_s": 1e-4, "bandwidth": 2.5e8, "node_bandwidth": 2.5e8}


def _load_job(job_file: str, overrides: list[str]):
    from mpihybrid.config import build_job, load_table, resolve

    job = build_job(load_table(job_file), overrides)
    if job.grid.dp == -1:
        raise ValueError("grid.dp = -1 takes the world size from mpiexec: give --set grid.dp=N")
    return resolve(job, job.grid.pp * max(job.grid.dp, 1))


def _calibrate(trace_path: str, cluster_path: str) -> None:
    from mpihybrid.predict.calibrate import calibrate
    from mpihybrid.predict.cluster import ClusterError, Link, load_cluster, write_cluster
    from mpihybrid.trace.file import load

    try:  # keep the network figures of the file being replaced (no second node to measure)
        network = load_cluster(cluster_path).links["network"]
    except ClusterError:
        network = Link(**_TWONODE)
    cluster, notes = calibrate(load(trace_path), network)
    notes.update({f"links.network.{k}": "kept: no second node to measure" for k in _TWONODE})
    header = (
        f"This machine, fitted by: mpihybrid predict JOB --calibrate {trace_path}\n"
        "Times drift by +-20% minute to minute on a shared 2-core machine: calibrate and\n"
        "compare in one sitting."
    )
    write_cluster(cluster_path, cluster, header, notes)


def format_prediction(r: dict) -> str:
    j, unit = r["job"], r["unit"]
    lines = [
        f"== predict: {j['model']}, pp={j['pp']} x dp={j['dp']} ({j['order']}), {j['schedule']}, "
        f"M={j['microbatches']}, codec {j['codec']}, on {r['cluster']}",
        f"step time      {1e3 * r['step_time_s']:.2f} ms (pipeline {1e3 * r['pipeline_s']:.2f} ms)",
        f"throughput     {r['throughput']:,.0f} {unit}/s",
        f"bubble         {r['bubble']:.3f}",
        f"exposed comm   {1e3 * r['exposed_comm_s']:.2f} ms (ring time past the last compute)",
        f"efficiency     {100 * r['efficiency']:.1f}% of the device's GEMM rate",
        f"message        {1e3 * r['message_s']:.3f} ms per pipeline hop",
        "stage  params      F ms     B ms     W ms   ring ms    opt ms",
    ]
    for s in r["stages"]:
        lines.append(
            f"{s['stage']:>5}  {s['params']:>10,} {1e3 * s['forward_s']:>8.2f} "
            f"{1e3 * s['backward_s']:>8.2f} {1e3 * s['weight_s']:>8.2f} "
            f"{1e3 * s['allreduce_s']:>9.2f} {1e3 * s['optimizer_s']:>9.2f}"
        )
    lines.append("memory per rank (state = parameters, gradients, optimizer, residual):")
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
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one job setting (repeatable).")  # fmt: skip
@click.option("--cluster", "cluster_path", default=DEFAULT_CLUSTER, show_default=True,
              metavar="CLUSTER.toml", help="The cluster file to predict on.")  # fmt: skip
@click.option("--calibrate", "trace_path", metavar="TRACE.h5",
              help="Fit this machine to a trace of a real run; write --cluster first.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Every figure as JSON.")
def predict(job_file, overrides, cluster_path, trace_path, as_json) -> None:
    """Predict JOB_FILE's step time, throughput, bubble, exposed communication and memory."""
    from mpihybrid.config import ConfigError
    from mpihybrid.pipeline.schedules import ScheduleError
    from mpihybrid.predict.cluster import ClusterError, load_cluster
    from mpihybrid.predict.model import predict as run_prediction
    from mpihybrid.trace.file import TraceError

    try:
        job = _load_job(job_file, list(overrides))
        if trace_path is not None:
            if not Path(trace_path).is_file():
                raise ValueError(f"trace {trace_path!r} does not exist")
            _calibrate(trace_path, cluster_path)
        result = run_prediction(job, load_cluster(cluster_path))
    except (ConfigError, ClusterError, ScheduleError, TraceError, ValueError, OSError) as exc:
        _fail(str(exc))
    click.echo(json.dumps(result, indent=1) if as_json else format_prediction(result))
