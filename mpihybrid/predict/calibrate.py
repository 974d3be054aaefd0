"""Fit a cluster file for this machine from a trace of a real run and a few micro-benchmarks.

    mpiexec -n 2 mpihybrid train jobs/gpt_bench.toml --set train.steps=8 --trace runs/cal.h5
    mpihybrid predict jobs/bench_pp2.toml --calibrate runs/cal.h5 --cluster clusters/local.toml

From the trace (the steps after the first):
    gemm_flops, mem_bandwidth, op_overhead_s   least squares (>= 0) of every stage's mean F, B and
                                               W against its FLOPs, elementwise bytes and layer
                                               calls (model.stage_work)
    optimizer_bandwidth                        nominal optimizer bytes / the optimizer rows' time
    links.node.alpha_s                         the median hop of a message whose receiver waited
                                               (analysis.metrics.message_latency), less its bytes
                                               at the link's bandwidth
    links.node.bandwidth                       the ring rows' bytes over their time when the run
                                               had dp > 1; else a copy micro-benchmark / 2 (a
                                               shared-memory message is copied in and out)
    step_overhead_s                            the measured median step less the prediction
Micro-benchmarks of this process: each codec's encode and decode-add on 4 Mi floats, a 64 MiB
copy, and the resident memory of a fresh interpreter that imported the trainer and MPI.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import subprocess
import sys
import time

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mpihybrid.analysis.metrics import message_latency, stage_costs
from mpihybrid.comm.codecs import CODECS, get_codec
from mpihybrid.config import build_job, resolve
from mpihybrid.predict.cluster import Cluster, CodecRate, Device, Link, Node
from mpihybrid.predict.model import (
    FLOAT,
    KINDS,
    OPTIMIZER_BYTES,
    predict,
    stage_work,
)
from mpihybrid.trace.file import Trace
from mpihybrid.trace.recorder import KIND, step_times


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm up (scratch buffers, compiled kernels)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def codec_rates(count: int = 1 << 22) -> dict[str, CodecRate]:
    """Float32 bytes per second each codec encodes and decode-adds, on one core."""
    x = np.random.default_rng(0).standard_normal(count).astype(np.float32)
    acc = np.zeros_like(x)
    rates = {}
    for name in CODECS:
        codec = get_codec(name)
        wire = np.empty(codec.nbytes(count), np.uint8)
        encode = _median_seconds(lambda c=codec, w=wire: c.encode(x, w))
        decode = _median_seconds(lambda c=codec, w=wire: c.decode_add(w, count, acc))
        rates[name] = CodecRate(encode=FLOAT * count / encode, decode=FLOAT * count / decode)
    return rates


def copy_bandwidth(nbytes: int = 64 << 20) -> float:
    """Bytes per second of one large copy (read + write counted once, as a message's bytes)."""
    a = np.ones(nbytes // FLOAT, np.float32)
    b = np.empty_like(a)
    return nbytes / _median_seconds(lambda: np.copyto(b, a))


def warm_runtime() -> None:
    """What a rank loads before its arrays grow: the trainer, MPI, and every compiled kernel (one
    tiny GPT and MLP step, each codec, both optimizers); prints this process's peak RSS (VmHWM)."""
    from mpi4py import MPI  # noqa: F401  (MPI_Init: its shared memory counts)

    from mpihybrid.nn.model import build_stage
    from mpihybrid.nn.optim import SGD, AdamW

    for sets, x in (
        (["model.kind=gpt", "model.hidden=32", "model.heads=2", "model.depth=1",
          "data.kind=random-tokens", "data.vocab=64", "data.seq_len=8"], np.zeros((2, 8), int)),
        (["model.activation=gelu", "model.norm=true", "model.hidden=32", "data.features=8"],
         np.ones((4, 8), np.float32)),
        (["model.hidden=32", "data.features=8"], np.ones((4, 8), np.float32)),
    ):  # fmt: skip
        job = build_job({}, sets)
        in_features = job.data.seq_len if job.model.kind == "gpt" else job.data.features
        classes = job.data.vocab if job.model.kind == "gpt" else 2
        stage = build_stage(job.model, in_features, classes, 0, 1, seed=0)
        y, cache = stage.forward(x)
        dx, wcache = stage.backward_input(np.ones_like(y), cache, False)
        stage.backward_weight(wcache)
        for opt in (SGD(stage.flat_params, 0.1, 0.9), AdamW(stage.flat_params, 0.1, (0.9, 0.99))):
            opt.step(stage.flat_grads)
    flat = np.ones(4096, np.float32)
    for name in CODECS:
        codec = get_codec(name)
        wire = np.empty(codec.nbytes(flat.size), np.uint8)
        codec.encode(flat, wire)
        codec.decode_add(wire, flat.size, flat)
    print([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0])


def base_memory() -> int:
    """Peak resident bytes of a fresh interpreter after warm_runtime (VmHWM: a child's
    ru_maxrss would start from this process's own peak)."""
    code = "from mpihybrid.predict.calibrate import warm_runtime; warm_runtime()"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "HYDRA"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return 1024 * int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0, exactly, by trying every set of free columns (few columns)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(b**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = sol
            err = float(np.sum((a @ x - b) ** 2))
            if err < best_err:
                best, best_err = x, err
    return best


def trace_job(trace: Trace):
    """The job the trace ran, resolved for its grid."""
    table = tomllib.loads(trace.config)
    job = build_job(table)
    pp, dp = int(trace.attrs["pp"]), int(trace.attrs["dp"])
    return resolve(job, pp * dp)


def _fit_compute(trace: Trace, job, events: np.ndarray) -> tuple[np.ndarray, int]:
    """(1/gemm_flops, 1/mem_bandwidth, op_overhead_s) from every stage's mean F, B, W."""
    work = stage_work(job)
    means = stage_costs(events, len(work))
    split = {int(s) for s in events["stage"][events["kind"] == KIND["weight"]]}
    rows, targets = [], []
    for s, w in enumerate(work):
        for kind, name in zip(KINDS, ("forward", "backward", "weight"), strict=True):
            if kind == "W" and s not in split:
                continue
            feature = np.array([w.flops[kind], w.elem_bytes[kind], w.ops[kind]], float)
            if kind == "B" and s not in split:  # an unsplit backward did the W work too
                feature += [w.flops["W"], w.elem_bytes["W"], w.ops["W"]]
            rows.append(feature)
            targets.append(means[name][s])
    a = np.array(rows)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    return nnls(a / scale, np.array(targets)) / scale, len(rows)


def calibrate(trace: Trace, network: Link) -> tuple[Cluster, dict[str, str]]:
    """This machine as a Cluster fitted to `trace`, and a note per field saying where it came
    from. `network` (no second node here) is kept as given."""
    job = trace_job(trace)
    events = trace.events
    steps = sorted(set(int(s) for s in events["step"] if s >= 1)) or [0]
    ev = events[np.isin(events["step"], steps)]
    (inv_flops, inv_bw, op_s), n_rows = _fit_compute(trace, job, ev)
    copy = copy_bandwidth()
    work = stage_work(job)
    opt_rows = ev[ev["kind"] == KIND["optimizer"]]
    name = (
        "sgd+momentum"
        if job.train.optimizer == "sgd" and job.train.momentum
        else job.train.optimizer
    )
    # one update per (rank, step, stage), however many buckets it came in
    updates = {(int(e["rank"]), int(e["step"]), int(e["stage"])) for e in opt_rows}
    nominal = sum(OPTIMIZER_BYTES[name] * work[s].params for _, _, s in updates)
    opt_s = float((opt_rows["end"] - opt_rows["start"]).sum())
    notes = {}
    node_bw, node_note = copy / 2, "a 64 MiB copy / 2 (copied in and out of shared memory)"
    ring = ev[ev["kind"] == KIND["allreduce"]]
    if job.grid.dp > 1 and len(ring):
        took = float(np.sum(ring["end"] - ring["start"]))
        node_bw = float(ring["bytes"].sum()) / took
        node_note = "the trace's ring bytes / ring time"
    hop = message_latency(ev)
    hop_bytes = max((w.input_bytes for w in work), default=0)
    alpha = max(1e-6, hop - hop_bytes / node_bw)
    device = Device(
        gemm_flops=1 / inv_flops if inv_flops > 0 else 1e12,
        mem_bandwidth=1 / inv_bw if inv_bw > 0 else copy,
        optimizer_bandwidth=nominal / opt_s if opt_s > 0 else copy,
        op_overhead_s=float(op_s),
        step_overhead_s=0.0,
        base_memory_bytes=float(base_memory()),
        host_copy_bandwidth=0.0,
    )
    cluster = Cluster(
        name="local",
        node=Node(ranks_per_node=os.cpu_count() or 1, memory_bytes=_ram()),
        device=device,
        links={"node": Link(alpha, node_bw), "network": network},
        codecs=codec_rates(),
    )
    measured = statistics.median([t for s, t in step_times(events).items() if s in steps])
    overhead = max(0.0, measured - predict(job, cluster)["step_time_s"])
    cluster = dataclasses.replace(
        cluster, device=dataclasses.replace(device, step_overhead_s=overhead)
    )
    fitted = f"least squares over {n_rows} stage means (F, B, W) of the trace"
    notes.update({
        "device.gemm_flops": fitted, "device.mem_bandwidth": fitted,
        "device.op_overhead_s": fitted,
        "device.optimizer_bandwidth": "nominal optimizer bytes / the trace's optimizer time",
        "device.step_overhead_s": f"median measured step {measured:.4f} s less the prediction",
        "device.base_memory_bytes": "peak RSS of a fresh interpreter after warm_runtime()",
        "device.host_copy_bandwidth": "0: arrays live on the host",
        "node.ranks_per_node": "os.cpu_count(): one rank per core",
        "node.memory_bytes": "MemTotal of /proc/meminfo",
        "links.node.alpha_s": f"median waited hop {hop * 1e6:.0f} us less its bytes",
        "links.node.bandwidth": node_note,
    })  # fmt: skip
    for codec in CODECS:
        for field in ("encode", "decode"):
            notes[f"codecs.{codec}.{field}"] = "4 Mi floats, median of 5, one core"
    return cluster, notes


def _ram() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0
