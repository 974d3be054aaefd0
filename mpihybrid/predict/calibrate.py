"""Fit a cluster file for this machine from a trace of a real run and a few micro-benchmarks.

    mpiexec -n 2 mpihybrid train jobs/gpt_bench.toml --set train.steps=8 --trace runs/cal.h5
    mpihybrid predict jobs/bench_pp2.toml --calibrate runs/cal.h5   # writes, says where

The micro-benchmarks run as the ranks do: as many worker processes as the trace had ranks on
this node (at most one per core), at once, each with one BLAS thread (a rank's); every figure
is the median over the workers. Per worker:
    gemm_flops, gemm_bandwidth, gemm_call_s    least squares (>= 0, relative) of the time of
                                               float32 GEMMs of GEMM_SHAPES, each on operands of
                                               its own that together outgrow the caches (as a
                                               stage's weights do), against their FLOPs, operand
                                               bytes and calls
    codecs.*                                   each codec's encode and decode-add on 4 Mi floats
    links.node.bandwidth (pp-only trace)       a 64 MiB copy / 2 (copied in and out of shared
                                               memory)
From the trace (the steps after the first):
    mem_bandwidth, op_overhead_s               least squares (>= 0) of every stage's median F, B
                                               and W, less its GEMMs at the rates above, against
                                               its elementwise bytes and layer calls (nn.cost)
    optimizer_bandwidth                        the optimizer's bytes / the optimizer rows' time
    links.node.alpha_s                         the median hop of a message whose receiver waited
                                               (analysis.messages.message_latency), less its bytes
                                               at the link's bandwidth
    links.node.bandwidth (dp > 1)              the ring rows' bytes over their time
    base_memory_bytes                          each rank's peak resident set over the steps
                                               (the trace's peak_rss_bytes) less the arrays the
                                               model counts for it, the median over ranks;
                                               without that record, the peak of a fresh
                                               interpreter after warm_runtime()
    step_overhead_s                            the measured median step less the prediction
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mpihybrid.analysis.messages import message_latency
from mpihybrid.comm.codecs import CODECS
from mpihybrid.config import build_job, resolve
from mpihybrid.nn.cost import KINDS, stage_work
from mpihybrid.predict.cluster import Cluster, Device, Link, Node
from mpihybrid.predict.microbench import (
    GEMM_SHAPES,
    base_memory,
    fit_gemm,
    kernel_memory,
    loaded_rates,
    nnls,
)
from mpihybrid.predict.model import gemm_seconds, optimizer_bytes, predict, rank_memory
from mpihybrid.trace.read import Trace
from mpihybrid.trace.recorder import KIND, step_times


def trace_job(trace: Trace):
    """The job the trace ran, resolved for its grid."""
    table = tomllib.loads(trace.config)
    job = build_job(table)
    pp, dp = int(trace.attrs["pp"]), int(trace.attrs["dp"])
    return resolve(job, pp * dp)


def stage_medians(events: np.ndarray, num_stages: int) -> dict[str, list[float]]:
    """Median seconds of one F, B and W per stage (0.0 where a stage has none of that kind):
    on a shared machine a few actions that another process interrupted move a mean, not a
    median."""
    out = {}
    for name in ("forward", "backward", "weight"):
        rows = events[events["kind"] == KIND[name]]
        took = [(rows["end"] - rows["start"])[rows["stage"] == s] for s in range(num_stages)]
        out[name] = [float(np.median(t)) if len(t) else 0.0 for t in took]
    return out


def _fit_elementwise(job, events: np.ndarray, device: Device) -> tuple[float, float, int]:
    """(mem_bandwidth, op_overhead_s, rows fitted): every stage's median F, B, W less its GEMMs
    at `device`'s rates, against its elementwise bytes and layer calls."""
    work = stage_work(job.workload)
    means = stage_medians(events, len(work))
    split = {int(s) for s in events["stage"][events["kind"] == KIND["weight"]]}
    rows, targets = [], []
    for s, w in enumerate(work):
        for kind, name in zip(KINDS, ("forward", "backward", "weight"), strict=True):
            if kind == "W" and s not in split:
                continue
            kinds = (kind, "W") if kind == "B" and s not in split else (kind,)  # B did W's work
            gemm = sum(gemm_seconds(g, device) for k in kinds for g in w.gemms(k))
            rows.append([sum(w.elem_bytes(k) for k in kinds), sum(w.calls(k) for k in kinds)])
            targets.append(means[name][s] - gemm)
    a = np.array(rows, float)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    inv_bw, call = nnls(a / scale, np.array(targets)) / scale
    return (1 / inv_bw if inv_bw > 0 else 0.0), float(call), len(rows)


def _optimizer_bandwidth(job, events: np.ndarray, copy: float) -> float:
    """The optimizer's bytes over the optimizer rows' time (one update per rank, step and stage,
    however many buckets it came in)."""
    work = stage_work(job.workload)
    rows = events[events["kind"] == KIND["optimizer"]]
    updates = {(int(e["rank"]), int(e["step"]), int(e["stage"])) for e in rows}
    nbytes = sum(optimizer_bytes(job) * work[s].params for _, _, s in updates)
    took = float((rows["end"] - rows["start"]).sum())
    return nbytes / took if took > 0 else copy


def _base_memory(trace: Trace, job, cluster: Cluster) -> tuple[float, str]:
    """A rank's runtime bytes without compiled kernels: the trace's measured peaks less the
    model's arrays (median over ranks) less the kernels' share when the trace's job ran them; or
    a fresh interpreter's peak where the trace has no such record."""
    from mpihybrid.predict.model import runs_compiled_kernels

    measured = trace.attrs.get("peak_rss_bytes")
    if not measured:
        return float(base_memory()), "peak RSS of a fresh interpreter after warm_runtime()"
    g, actions = job.grid, job.schedule.lists()
    work = stage_work(job.workload)
    bare = dataclasses.replace(
        cluster,
        device=dataclasses.replace(cluster.device, base_memory_bytes=0.0, kernel_memory_bytes=0.0),
    )
    arrays = [rank_memory(job, work, actions[r], bare)["total_bytes"] for r in range(g.pp)]
    rest = [float(m) - arrays[g.layout.coords(r)[0]] for r, m in enumerate(measured)]
    kernels = cluster.device.kernel_memory_bytes if runs_compiled_kernels(job) else 0.0
    mib = ", ".join(f"{m / 2**20:.0f}" for m in measured)
    return statistics.median(rest) - kernels, (
        f"the trace's peak RSS per rank ({mib} MiB) less the arrays"
        + (" and kernel_memory_bytes" if kernels else "")
    )


def trace_ranks(trace: Trace) -> int:
    """Ranks the trace's job ran (all on this node)."""
    return int(trace.attrs["pp"]) * int(trace.attrs["dp"])


def calibrate(
    trace: Trace, network: Link, workers: int | None = None
) -> tuple[Cluster, dict[str, str]]:
    """This machine as a Cluster fitted to `trace`, and a note per field saying where it came
    from. `network` (no second node here) is kept as given. `workers`: micro-benchmark processes
    at once (default: the trace's ranks, at most one per core)."""
    job = trace_job(trace)
    events = trace.events
    steps = sorted(set(int(s) for s in events["step"] if s >= 1)) or [0]
    ev = events[np.isin(events["step"], steps)]
    workers = workers or max(1, min(trace_ranks(trace), os.cpu_count() or 1))
    rates = loaded_rates(workers)
    gemms = list(zip(GEMM_SHAPES, rates["gemm"], strict=True))
    gemm_flops, gemm_bandwidth, gemm_call = fit_gemm(gemms)
    copy = rates["copy"]
    device = Device(
        gemm_flops=gemm_flops,
        gemm_bandwidth=gemm_bandwidth,
        gemm_call_s=gemm_call,
        mem_bandwidth=copy,
        optimizer_bandwidth=_optimizer_bandwidth(job, ev, copy),
        op_overhead_s=0.0,
        step_overhead_s=0.0,
        base_memory_bytes=0.0,
        host_copy_bandwidth=0.0,
    )
    mem_bw, op_s, n_rows = _fit_elementwise(job, ev, device)
    device = dataclasses.replace(device, mem_bandwidth=mem_bw or copy, op_overhead_s=op_s)
    node_bw, node_note = copy / 2, "a 64 MiB copy / 2 (copied in and out of shared memory)"
    ring = ev[ev["kind"] == KIND["allreduce"]]
    if job.grid.dp > 1 and len(ring):
        node_bw = float(ring["bytes"].sum()) / float(np.sum(ring["end"] - ring["start"]))
        node_note = "the trace's ring bytes / ring time"
    hop = message_latency(ev)
    hop_bytes = max((w.input_bytes for w in stage_work(job.workload)), default=0)
    cluster = Cluster(
        name="local",
        node=Node(
            ranks_per_node=os.cpu_count() or 1, memory_bytes=_ram(), cores=os.cpu_count() or 1
        ),
        device=device,
        links={"node": Link(max(1e-6, hop - hop_bytes / node_bw), node_bw), "network": network},
        codecs=rates["codecs"],
    )
    kernels = kernel_memory()
    cluster = dataclasses.replace(
        cluster, device=dataclasses.replace(cluster.device, kernel_memory_bytes=kernels)
    )
    base, base_note = _base_memory(trace, job, cluster)
    measured = statistics.median([t for s, t in step_times(events).items() if s in steps])
    device = dataclasses.replace(device, base_memory_bytes=base, kernel_memory_bytes=kernels)
    cluster = dataclasses.replace(cluster, device=device)
    overhead = max(0.0, measured - predict(job, cluster)["step_time_s"])
    cluster = dataclasses.replace(
        cluster, device=dataclasses.replace(device, step_overhead_s=overhead)
    )
    notes = _notes(
        workers=workers,
        gemms=len(gemms),
        rows=n_rows,
        measured=measured,
        base_note=base_note,
        hop=hop,
        node_note=node_note,
    )
    return cluster, notes


def _notes(
    *,
    workers: int,
    gemms: int,
    rows: int,
    measured: float,
    base_note: str,
    hop: float,
    node_note: str,
) -> dict[str, str]:
    """Where each calibrated field came from, one note per field."""
    loaded = f"{workers} workers at once, one BLAS thread each, median over them"
    gemm_note = (
        f"least squares over {gemms} GEMM shapes (calibrate.GEMM_SHAPES), "
        f"operands out of cache, median of 5 rounds; {loaded}"
    )
    fitted = f"least squares over {rows} stage medians (F, B, W) of the trace less their GEMMs"
    notes = {
        "device.gemm_flops": gemm_note,
        "device.gemm_bandwidth": gemm_note,
        "device.gemm_call_s": gemm_note,
        "device.mem_bandwidth": fitted,
        "device.op_overhead_s": fitted,
        "device.optimizer_bandwidth": "the optimizer's bytes / the trace's optimizer time",
        "device.step_overhead_s": f"median measured step {measured:.4f} s less the prediction",
        "device.base_memory_bytes": base_note,
        "device.kernel_memory_bytes": "a fresh interpreter's peak RSS after warm_runtime() "
        "less one's after the imports and MPI alone (bare_runtime())",
        "device.host_copy_bandwidth": "0: arrays live on the host",
        "node.ranks_per_node": "os.cpu_count(): one rank per core (--ranks-per-node: more)",
        "node.cores": "os.cpu_count(): more ranks than this share the cores",
        "node.memory_bytes": "MemTotal of /proc/meminfo",
        "links.node.alpha_s": f"median waited hop {hop * 1e6:.0f} us less its bytes",
        "links.node.bandwidth": node_note,
    }
    for codec in CODECS:
        for field in ("encode", "decode"):
            notes[f"codecs.{codec}.{field}"] = f"4 Mi floats, median of 5; {loaded}"
    return notes


def _ram() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0
