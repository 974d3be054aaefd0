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
import itertools
import json
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

from mpihybrid.analysis.messages import message_latency
from mpihybrid.comm.codecs import CODECS, get_codec
from mpihybrid.config import build_job, resolve
from mpihybrid.launch import without_launcher
from mpihybrid.nn.cost import FLOAT, KINDS, stage_work
from mpihybrid.pipeline.schedules import build_schedule
from mpihybrid.predict.cluster import Cluster, CodecRate, Device, Link, Node
from mpihybrid.predict.model import gemm_seconds, optimizer_bytes, predict, rank_memory
from mpihybrid.trace.read import Trace
from mpihybrid.trace.recorder import KIND, step_times

# (batch, m, k, n): square, wide, tall and skinny products from 32 to 8192 and batches of small
# ones (attention heads) -- shapes of their own, not of the jobs the model is held against
GEMM_SHAPES = [
    (1, 32, 512, 512), (1, 128, 512, 512), (1, 512, 512, 512), (1, 64, 2048, 2048),
    (1, 256, 2048, 2048), (1, 128, 256, 4096), (1, 128, 4096, 256), (1, 512, 256, 4096),
    (1, 256, 128, 8192), (1, 1024, 128, 1024), (1, 2048, 2048, 64), (32, 32, 32, 32),
    (32, 128, 32, 128), (16, 128, 128, 128),
]  # fmt: skip


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm up (scratch buffers, compiled kernels)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_times(shapes: list[tuple], rounds: int = 5, budget: int = 64 << 20) -> list[float]:
    """Seconds of one float32 GEMM of each shape, each cycling through operands of its own that
    add up to `budget` bytes (more than the caches hold, as a stage's weights in training); the
    median of `rounds` rounds over all the shapes, so that a busy moment of a shared machine
    slows one round of every shape rather than every round of one."""
    rng = np.random.default_rng(0)
    times: list[list[float]] = [[] for _ in shapes]
    for _ in range(rounds):
        for i, (b, m, k, n) in enumerate(shapes):
            count = max(2, budget // (FLOAT * b * (m * k + k * n + m * n)))
            operands = [
                (rng.standard_normal((b, m, k), np.float32),
                 rng.standard_normal((b, k, n), np.float32), np.empty((b, m, n), np.float32))
                for _ in range(count)
            ]  # fmt: skip

            def run(operands=operands) -> None:
                for x, w, out in operands:
                    np.matmul(x, w, out=out)

            times[i].append(_median_seconds(run, repeats=1) / count)
    return [statistics.median(t) for t in times]


def fit_gemm(measured: list[tuple[tuple, float]]) -> tuple[float, float, float]:
    """(gemm_flops, gemm_bandwidth, gemm_call_s) of t = 2bmkn / flops + 4b(mk+kn+mn) / bandwidth
    + b call, least squares (>= 0) of the relative error over the measured shapes."""
    a = np.array([[2 * b * m * k * n, FLOAT * b * (m * k + k * n + m * n), b]
                  for (b, m, k, n), _ in measured], float)  # fmt: skip
    t = np.array([seconds for _, seconds in measured])
    scale = a.max(axis=0)
    inv_flops, inv_bw, call = nnls(a / scale / t[:, None], np.ones_like(t)) / scale
    if inv_flops <= 0:  # the FLOPs explain nothing: one rate over everything
        inv_flops, inv_bw, call = float(np.sum(t) / np.sum(a[:, 0])), 0.0, 0.0
    return float(1 / inv_flops), float(1 / inv_bw) if inv_bw > 0 else 0.0, float(call)


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

    from mpihybrid.nn.data import task_dims
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
        stage = build_stage(job.model, *task_dims(job.data), 0, 1, seed=0)
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
    env = without_launcher(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return 1024 * int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0


def measure_rates() -> dict:
    """This process's micro-benchmarks: GEMM seconds per shape, codec rates, copy bandwidth."""
    codecs = codec_rates()
    return {
        "gemm": gemm_times(GEMM_SHAPES),
        "codecs": {name: [r.encode, r.decode] for name, r in codecs.items()},
        "copy": copy_bandwidth(),
    }


def _worker_env() -> dict[str, str]:
    """A worker's environment: one BLAS thread, no MPI launcher's variables."""
    from mpihybrid._threads import THREAD_VARS

    env = without_launcher(os.environ)
    return {**env, **dict.fromkeys(THREAD_VARS, "1")}


def loaded_rates(workers: int) -> dict:
    """measure_rates in `workers` processes started together (each one BLAS thread, as a rank
    has, every core the job used busy): per figure, the median over the workers."""
    cmd = [sys.executable, "-m", "mpihybrid.predict.calibrate"]
    procs = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=_worker_env())
        for _ in range(workers)
    ]  # fmt: skip
    try:
        for p in procs:  # every worker has loaded numpy and the kernels: start them together
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a calibration worker failed to start")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate()[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError("a calibration worker failed (run `python -m mpihybrid.predict."
                           "calibrate` to see why)")  # fmt: skip
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    median = statistics.median
    return {
        "workers": workers,
        "gemm": [median(r["gemm"][i] for r in results) for i in range(len(GEMM_SHAPES))],
        "codecs": {
            name: CodecRate(*(median(r["codecs"][name][j] for r in results) for j in (0, 1)))
            for name in CODECS
        },
        "copy": median(r["copy"] for r in results),
    }


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
    work = stage_work(job)
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
    work = stage_work(job)
    rows = events[events["kind"] == KIND["optimizer"]]
    updates = {(int(e["rank"]), int(e["step"]), int(e["stage"])) for e in rows}
    nbytes = sum(optimizer_bytes(job) * work[s].params for _, _, s in updates)
    took = float((rows["end"] - rows["start"]).sum())
    return nbytes / took if took > 0 else copy


def kernel_memory() -> float:
    """What numba's runtime and the compiled kernels add to a rank: a fresh interpreter's peak
    after warm_runtime() less one's after the same imports and MPI alone."""
    code = "from mpihybrid.predict.calibrate import bare_runtime; bare_runtime()"
    env = without_launcher(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    bare = 1024 * int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    return max(0.0, float(base_memory() - bare)) if bare else 0.0


def bare_runtime() -> None:
    """The trainer's imports and MPI, no compiled kernel; prints this process's VmHWM (KiB)."""
    from mpi4py import MPI  # noqa: F401

    import mpihybrid.nn.model  # noqa: F401
    import mpihybrid.train.loop  # noqa: F401

    print([line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0])


def _base_memory(trace: Trace, job, cluster: Cluster) -> tuple[float, str]:
    """A rank's runtime bytes without compiled kernels: the trace's measured peaks less the
    model's arrays (median over ranks) less the kernels' share when the trace's job ran them; or
    a fresh interpreter's peak where the trace has no such record."""
    from mpihybrid.predict.model import runs_compiled_kernels

    measured = trace.attrs.get("peak_rss_bytes")
    if not measured:
        return float(base_memory()), "peak RSS of a fresh interpreter after warm_runtime()"
    g, t = job.grid, job.train
    actions = build_schedule(t.schedule, g.pp, t.microbatches, t.virtual_stages, t.early_grad_send)
    work = stage_work(job)
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
        gemm_flops=gemm_flops, gemm_bandwidth=gemm_bandwidth, gemm_call_s=gemm_call,
        mem_bandwidth=copy, optimizer_bandwidth=_optimizer_bandwidth(job, ev, copy),
        op_overhead_s=0.0, step_overhead_s=0.0, base_memory_bytes=0.0, host_copy_bandwidth=0.0,
    )  # fmt: skip
    mem_bw, op_s, n_rows = _fit_elementwise(job, ev, device)
    device = dataclasses.replace(device, mem_bandwidth=mem_bw or copy, op_overhead_s=op_s)
    node_bw, node_note = copy / 2, "a 64 MiB copy / 2 (copied in and out of shared memory)"
    ring = ev[ev["kind"] == KIND["allreduce"]]
    if job.grid.dp > 1 and len(ring):
        node_bw = float(ring["bytes"].sum()) / float(np.sum(ring["end"] - ring["start"]))
        node_note = "the trace's ring bytes / ring time"
    hop = message_latency(ev)
    hop_bytes = max((w.input_bytes for w in stage_work(job)), default=0)
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
    loaded = f"{workers} workers at once, one BLAS thread each, median over them"
    gemm_note = (f"least squares over {len(gemms)} GEMM shapes (calibrate.GEMM_SHAPES), "
                 f"operands out of cache, median of 5 rounds; {loaded}")  # fmt: skip
    fitted = f"least squares over {n_rows} stage medians (F, B, W) of the trace less their GEMMs"
    notes = {
        "device.gemm_flops": gemm_note, "device.gemm_bandwidth": gemm_note,
        "device.gemm_call_s": gemm_note,
        "device.mem_bandwidth": fitted, "device.op_overhead_s": fitted,
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
    }  # fmt: skip
    for codec in CODECS:
        for field in ("encode", "decode"):
            notes[f"codecs.{codec}.{field}"] = f"4 Mi floats, median of 5; {loaded}"
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


if __name__ == "__main__":  # a worker of loaded_rates: ready, wait for "go", JSON of its rates
    from mpihybrid.nn import kernels  # noqa: F401  (compiled kernels load before the start)

    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(measure_rates()), flush=True)
