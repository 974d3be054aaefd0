"""The weight gradient's GEMM accumulated in place (nn/gemm.py) against numpy's g += x.T @ dy,
interleaved in one process, on the weight-gradient shapes of jobs/gpt_bench.toml.

    OMP_NUM_THREADS=1 python benchmarks/gemm_ab.py                 # 40 rounds
    OMP_NUM_THREADS=1 python benchmarks/gemm_ab.py --rows 512      # 4 micro-batches merged

Each round times Linear.backward_weight with the in-place call, then with numpy's expression,
on the same inputs (the gradient zeroed before each), so a drifting machine hits both alike;
printed: median ms of each, their ratio, and the rate against one sgemm of the same shape
written to a fresh array (np.matmul with out=, as bench train's roofline measures it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mpihybrid.nn import gemm
from mpihybrid.nn.layers import Linear

C, F, V = 240, 2048, 10_000  # gpt_bench: width, FFN, vocab
SHAPES = {"qkv": (C, 3 * C), "proj": (C, C), "up": (C, F), "down": (F, C), "head": (C, V)}


def _median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times[1:])  # the first round warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--rows", type=int, default=128, help="rows of x (2 x 64 tokens: 128)")
    args = parser.parse_args()
    if not gemm.available():
        raise SystemExit("nn/gemm: numpy's OpenBLAS sgemm is not found here; nothing to compare")
    rng = np.random.default_rng(0)
    print(f"rows = {args.rows}; {'weight':<8} {'in-place ms':>11} {'numpy ms':>9} {'speed-up':>9}"
          f" {'roofline ms':>11} {'of roofline':>11}")  # fmt: skip
    totals = {True: 0.0, False: 0.0, "roof": 0.0}
    for name, (n_in, n_out) in SHAPES.items():
        layer = Linear(n_in, n_out)
        params = {
            "weight": np.zeros((n_in, n_out), np.float32),
            "bias": np.zeros(n_out, np.float32),
        }
        grads = {k: np.zeros_like(v) for k, v in params.items()}
        layer.bind(params, grads)
        x = rng.standard_normal((args.rows, n_in)).astype(np.float32)
        dy = rng.standard_normal((args.rows, n_out)).astype(np.float32)
        xt, out = np.ascontiguousarray(x.T), np.empty((n_in, n_out), np.float32)
        times = {True: [], False: [], "roof": []}
        for _ in range(args.rounds + 1):
            for enabled in (True, False):
                gemm.ENABLED = enabled
                grads["weight"][...] = 0.0
                start = time.perf_counter()
                layer.backward_weight((x, dy))
                times[enabled].append(time.perf_counter() - start)
            start = time.perf_counter()
            np.matmul(xt, dy, out=out)
            times["roof"].append(time.perf_counter() - start)
        gemm.ENABLED = True
        fast, ref, roof = (_median_ms(times[k]) for k in (True, False, "roof"))
        for k, v in ((True, fast), (False, ref), ("roof", roof)):
            totals[k] += v
        print(f"{'':>12}{name:<8} {fast:11.3f} {ref:9.3f} {ref / fast:8.2f}x {roof:11.3f}"
              f" {roof / fast:11.2f}")  # fmt: skip
    fast, ref, roof = totals[True], totals[False], totals["roof"]
    print(f"{'':>12}{'all':<8} {fast:11.3f} {ref:9.3f} {ref / fast:8.2f}x {roof:11.3f}"
          f" {roof / fast:11.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
