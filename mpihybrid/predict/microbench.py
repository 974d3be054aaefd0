"""This machine on its own, as predict --calibrate measures it: float32 GEMMs of GEMM_SHAPES,
every codec's encode and decode, a large copy, each in as many worker processes at once as a
job's ranks (one BLAS thread each), and what a rank's runtime holds in memory before its arrays
(warm_runtime, bare_runtime). calibrate.py fits a cluster file from these and a trace.

    python -m mpihybrid.predict.microbench     # one worker: "ready", wait for "go", JSON rates
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from mpihybrid.comm.codecs import CODECS, get_codec
from mpihybrid.config import build_job
from mpihybrid.launch import without_launcher
from mpihybrid.nn.cost import FLOAT
from mpihybrid.predict.cluster import CodecRate

# (batch, m, k, n): square, wide, tall and skinny products from 32 to 8192 and batches of small
# ones (attention heads) -- shapes of their own, not of the jobs the model is held against
GEMM_SHAPES = [
    (1, 32, 512, 512),
    (1, 128, 512, 512),
    (1, 512, 512, 512),
    (1, 64, 2048, 2048),
    (1, 256, 2048, 2048),
    (1, 128, 256, 4096),
    (1, 128, 4096, 256),
    (1, 512, 256, 4096),
    (1, 256, 128, 8192),
    (1, 1024, 128, 1024),
    (1, 2048, 2048, 64),
    (32, 32, 32, 32),
    (32, 128, 32, 128),
    (16, 128, 128, 128),
]


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
                (
                    rng.standard_normal((b, m, k), np.float32),
                    rng.standard_normal((b, k, n), np.float32),
                    np.empty((b, m, n), np.float32),
                )
                for _ in range(count)
            ]

            def run(operands=operands) -> None:
                for x, w, out in operands:
                    np.matmul(x, w, out=out)

            times[i].append(_median_seconds(run, repeats=1) / count)
    return [statistics.median(t) for t in times]


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


def fit_gemm(measured: list[tuple[tuple, float]]) -> tuple[float, float, float]:
    """(gemm_flops, gemm_bandwidth, gemm_call_s) of t = 2bmkn / flops + 4b(mk+kn+mn) / bandwidth
    + b call, least squares (>= 0) of the relative error over the measured shapes."""
    a = np.array(
        [
            [2 * b * m * k * n, FLOAT * b * (m * k + k * n + m * n), b]
            for (b, m, k, n), _ in measured
        ],
        float,
    )
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
        (
            [
                "model.kind=gpt",
                "model.hidden=32",
                "model.heads=2",
                "model.depth=1",
                "data.kind=random-tokens",
                "data.vocab=64",
                "data.seq_len=8",
            ],
            np.zeros((2, 8), int),
        ),
        (
            ["model.activation=gelu", "model.norm=true", "model.hidden=32", "data.features=8"],
            np.ones((4, 8), np.float32),
        ),
        (["model.hidden=32", "data.features=8"], np.ones((4, 8), np.float32)),
    ):
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
    code = "from mpihybrid.predict.microbench import warm_runtime; warm_runtime()"
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
    cmd = [sys.executable, "-m", "mpihybrid.predict.microbench"]
    procs = [
        subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_worker_env()
        )
        for _ in range(workers)
    ]
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
        raise RuntimeError(
            "a calibration worker failed (run `python -m mpihybrid.predict.microbench` to see why)"
        )
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


def kernel_memory() -> float:
    """What numba's runtime and the compiled kernels add to a rank: a fresh interpreter's peak
    after warm_runtime() less one's after the same imports and MPI alone."""
    code = "from mpihybrid.predict.microbench import bare_runtime; bare_runtime()"
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


if __name__ == "__main__":  # a worker of loaded_rates: ready, wait for "go", JSON of its rates
    from mpihybrid.nn import kernels  # noqa: F401  (compiled kernels load before the start)

    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(measure_rates()), flush=True)
