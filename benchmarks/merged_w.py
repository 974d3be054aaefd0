"""What merging a stage's deferred W passes into one GEMM per weight would buy: K micro-batches'
weight gradients as K in-place GEMMs of R rows each (what the zero-bubble schedules run today,
nn/gemm.py), against one GEMM of K x R rows over the micro-batches' inputs and output gradients
concatenated, the concatenation timed with it (each micro-batch's x and dy were made at its own
F and B, so a merged W must gather them first). jobs/gpt_bench.toml's weight shapes, interleaved
round by round in one process.

    OMP_NUM_THREADS=1 python benchmarks/merged_w.py              # K = 4 micro-batches of 128 rows
    OMP_NUM_THREADS=1 python benchmarks/merged_w.py --merge 2 --rows 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mpihybrid.nn.layers import Linear

C, F, V = 240, 2048, 10_000  # gpt_bench: width, FFN, vocab
SHAPES = {"qkv": (C, 3 * C), "proj": (C, C), "up": (C, F), "down": (F, C), "head": (C, V)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--rows", type=int, default=128, help="rows of a micro-batch")
    parser.add_argument("--merge", type=int, default=4, help="micro-batches merged (K)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    k, rows = args.merge, args.rows
    print(f"{k} x {rows} rows    separate ms  merged GEMM ms  gather ms  merged ms"
          "  merged/separate")  # fmt: skip
    totals = np.zeros(4)
    for name, (n_in, n_out) in SHAPES.items():
        layer = Linear(n_in, n_out)
        params = {
            "weight": np.zeros((n_in, n_out), np.float32),
            "bias": np.zeros(n_out, np.float32),
        }
        grads = {key: np.zeros_like(v) for key, v in params.items()}
        layer.bind(params, grads)
        xs = [rng.standard_normal((rows, n_in)).astype(np.float32) for _ in range(k)]
        dys = [rng.standard_normal((rows, n_out)).astype(np.float32) for _ in range(k)]
        times: dict[str, list[float]] = {"separate": [], "gemm": [], "gather": []}
        for _ in range(args.rounds + 1):
            start = time.perf_counter()
            for x, dy in zip(xs, dys, strict=True):
                layer.backward_weight((x, dy))
            times["separate"].append(time.perf_counter() - start)
            start = time.perf_counter()
            x, dy = np.concatenate(xs), np.concatenate(dys)
            mid = time.perf_counter()
            layer.backward_weight((x, dy))
            times["gemm"].append(time.perf_counter() - mid)
            times["gather"].append(mid - start)
        separate, merged_gemm, gather = (
            1e3 * statistics.median(times[key][1:]) for key in ("separate", "gemm", "gather")
        )
        row = np.array([separate, merged_gemm, gather, merged_gemm + gather])
        totals += row
        print(f"  {name:<12} {row[0]:11.3f} {row[1]:15.3f} {row[2]:10.3f} {row[3]:10.3f}"
              f" {row[3] / row[0]:16.3f}")  # fmt: skip
    print(f"  {'all':<12} {totals[0]:11.3f} {totals[1]:15.3f} {totals[2]:10.3f} {totals[3]:10.3f}"
          f" {totals[3] / totals[0]:16.3f}  (GEMM alone {totals[1] / totals[0]:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
