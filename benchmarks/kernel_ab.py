"""Each fused numba kernel against its numpy reference, interleaved in one process.

    python benchmarks/kernel_ab.py                 # gpt_bench's shapes, 30 rounds
    python benchmarks/kernel_ab.py --rounds 60

Shapes are one micro-batch of jobs/gpt_bench.toml (b = 2 sequences x T = 64 tokens, C = 240,
F = 2048, 4 heads) and AdamW over stage 0's 6,068,304 parameters; the llama kind's layers at
docs/performance.md's llama shape (the same, SwiGLU width 640, 2 key/value heads). Each round
times the fast path, then the reference, on the same inputs, so a drifting machine hits both
alike; printed: median ms of each and their ratio. Runs on one core (set OMP_NUM_THREADS=1).
Every kernel the layers take must show >= 1.0x here (issue #31); the cross-entropy has none
(numpy's exp won), its row stays as the check that the numpy path is what runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mpihybrid import _numba
from mpihybrid.nn.layers import GELU, LayerNorm, Linear
from mpihybrid.nn.llama import RMSNorm, RotaryAttention, SwiGLU
from mpihybrid.nn.loss import SoftmaxCrossEntropy
from mpihybrid.nn.optim import AdamW
from mpihybrid.nn.transformer import CausalAttention, Embedding, Residual

B, T, C, F, HEADS, V, STAGE0_PARAMS = 2, 64, 240, 2048, 4, 10_000, 6_068_304


def cases(rng: np.random.Generator) -> dict:
    """name -> a function of no arguments that runs the op once (the path chosen at call time)."""
    x_ffn = rng.standard_normal((B, T, F)).astype(np.float32)
    gelu = GELU()
    gelu_cache = gelu.forward(x_ffn)[1]
    up = _linear(rng, C, F)
    biased = Residual([up, GELU()]).branch[1]  # a GELU that adds its Linear's bias
    pre = np.empty_like(x_ffn)

    def bias_gelu():  # the reference adds the bias as the Linear does, then its GELU
        np.copyto(pre, x_ffn)
        if not _numba.ENABLED:
            np.add(pre, up.params["bias"], out=pre)
        biased.forward(pre)

    x = rng.standard_normal((B, T, C)).astype(np.float32)
    norm = LayerNorm(C)
    norm.bind(
        {"weight": np.ones(C, np.float32), "bias": np.zeros(C, np.float32)},
        {"weight": np.zeros(C, np.float32), "bias": np.zeros(C, np.float32)},
    )
    norm_cache = norm.forward(x)[1]
    proj = _linear(rng, C, C)
    skip = rng.standard_normal((B, T, C)).astype(np.float32)
    qkv = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    attention = CausalAttention(C, HEADS, T)
    embedding = Embedding(V, T, C)
    shapes = {"tokens": (V, C), "positions": (T, C)}
    embedding.bind(*({k: np.zeros(s, np.float32) for k, s in shapes.items()} for _ in range(2)))
    tokens = rng.integers(0, V, (B, T))
    logits = rng.standard_normal((B, T, V)).astype(np.float32)
    work = np.empty_like(logits)
    targets = rng.integers(0, V, (B, T))

    def cross_entropy():  # the copy (about 0.5 ms) is in both paths' times
        np.copyto(work, logits)
        SoftmaxCrossEntropy().forward(work, targets)

    grads = rng.standard_normal(STAGE0_PARAMS).astype(np.float32)
    params = rng.standard_normal(STAGE0_PARAMS).astype(np.float32)
    optimizers = {}

    def adamw():
        key = _numba.ENABLED  # one optimizer per path: AdamW picks it when built
        if key not in optimizers:
            optimizers[key] = AdamW(params, lr=1e-9)
        optimizers[key].step(grads)

    return {
        "GELU forward (128 x 2048)": lambda: gelu.forward(x_ffn),
        "bias + GELU forward (128 x 2048)": bias_gelu,
        "GELU backward": lambda: gelu.backward(x_ffn, gelu_cache),
        "Linear 240->240 + bias + residual": lambda: proj.forward(x, skip=skip),
        "LayerNorm forward (128 x 240)": lambda: norm.forward(x),
        "LayerNorm backward (dx + dW)": lambda: norm.backward(x, norm_cache),
        "attention forward (2 x 4 heads x 64^2)": lambda: attention.forward(qkv),
        "attention backward": lambda: attention.backward(x, attention.forward(qkv)[1]),
        "embedding backward (128 tokens x 240)": lambda: embedding.backward_weight((tokens, x)),
        "cross-entropy forward (numpy in both)": cross_entropy,
        "AdamW step (6.07 M parameters)": adamw,
        **llama_cases(rng),
    }


def llama_cases(rng: np.random.Generator) -> dict:
    """The llama kind's layers: RMSNorm, SwiGLU (width 640), rotary attention (2 kv heads)."""
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    norm = RMSNorm(C)
    norm.bind({"weight": np.ones(C, np.float32)}, {"weight": np.zeros(C, np.float32)})
    norm_cache = norm.forward(x)[1]
    gate_up = rng.standard_normal((B, T, 2 * 640)).astype(np.float32)
    swiglu = SwiGLU()
    swiglu_cache = swiglu.forward(gate_up)[1]
    dy_ffn = rng.standard_normal((B, T, 640)).astype(np.float32)
    rotary = RotaryAttention(C, HEADS, 2, T)
    packed = rng.standard_normal((B, T, C + 2 * 2 * (C // HEADS))).astype(np.float32)
    dpacked = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    return {
        "RMSNorm forward (128 x 240)": lambda: norm.forward(x),
        "RMSNorm backward (dx + dW)": lambda: norm.backward(x, norm_cache),
        "SwiGLU forward (128 x 640)": lambda: swiglu.forward(gate_up),
        "SwiGLU backward": lambda: swiglu.backward(dy_ffn, swiglu_cache),
        "rotary pack (q, k rotated; kv heads x2)": lambda: rotary.pack(packed),
        "rotary unpack (its backward)": lambda: rotary.unpack(dpacked),
    }


def _linear(rng: np.random.Generator, fan_in: int, fan_out: int) -> Linear:
    layer = Linear(fan_in, fan_out)
    params = {
        "weight": (0.05 * rng.standard_normal((fan_in, fan_out))).astype(np.float32),
        "bias": rng.standard_normal(fan_out).astype(np.float32),
    }
    layer.bind(params, {k: np.zeros_like(v) for k, v in params.items()})
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if not _numba.ENABLED:
        raise SystemExit(f"kernels: {_numba.describe()}; install the fast extra")
    print(f"{'op':<40} {'numba ms':>9} {'numpy ms':>9} {'speed-up':>9}")
    for name, run in cases(np.random.default_rng(0)).items():
        times = {True: [], False: []}
        for _ in range(args.rounds + 1):  # the first round compiles and warms up
            for enabled in (True, False):
                _numba.ENABLED = enabled
                start = time.perf_counter()
                run()
                times[enabled].append(time.perf_counter() - start)
        _numba.ENABLED = True
        fast, ref = (statistics.median(times[k][1:]) for k in (True, False))
        print(f"{name:<40} {1e3 * fast:9.3f} {1e3 * ref:9.3f} {ref / fast:8.1f}x")


if __name__ == "__main__":
    main()
