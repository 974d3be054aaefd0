"""The weight gradient's GEMM accumulated in place (nn/gemm.py) against numpy's g += x.T @ dy,
interleaved in one process, on the weight-gradient shapes of jobs/gpt_bench.toml.

    OMP_NUM_THREADS=1 python benchmarks/gemm_ab.py                 # 40 rounds
    OMP_NUM_THREADS=1 python benchmarks/gemm_ab.py --rows 512      # 4 micro-batches merged
    OMP_NUM_THREADS=1 python benchmarks/gemm_ab.py --merge 4       # merged W, its gather counted
    OMP_NUM_THREADS=1 python benchmarks/gemm_ab.py --input-grad    # dy @ W^T's forms

Each round times Linear.backward_weight with the in-place call, then with numpy's expression,
on the same inputs (the gradient zeroed before each), so a drifting machine hits both alike;
printed: median ms of each, their ratio, and the rate against one sgemm of the same shape
written to a fresh array (np.matmul with out=, as bench train's roofline measures it).

--merge K: what merging a stage's deferred W passes into one GEMM per weight would buy. K
micro-batches' weight gradients as K in-place GEMMs of --rows rows each (what the zero-bubble
schedules run), against one GEMM of K x rows over the micro-batches' inputs and output gradients
concatenated, the concatenation timed with it (each micro-batch's x and dy were made at its own
F and B, so a merged W must gather them first).

--input-grad: the input gradient of the model's 17 weights (4 layers' qkv, proj, up, down and
the head), each its own array as in a step, as the layers compute it (dy @ W^T, the transposed
operand) against a contiguous copy of W^T kept beside W (dy @ W^T from it: the same bits),
(W @ dy^T)^T as a view and made contiguous, and what refreshing every W^T after an update costs
(numpy's transposing copy), interleaved round by round.
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


def _linear(n_in: int, n_out: int) -> tuple[Linear, dict[str, np.ndarray]]:
    """A Linear with zero weights and its gradients bound: (layer, grads)."""
    layer = Linear(n_in, n_out)
    params = {"weight": np.zeros((n_in, n_out), np.float32), "bias": np.zeros(n_out, np.float32)}
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    layer.bind(params, grads)
    return layer, grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--rows", type=int, default=128, help="rows of x (2 x 64 tokens: 128)")
    parser.add_argument("--merge", type=int, default=0, metavar="K",
                        help="merged W over K micro-batches instead (gather counted)")  # fmt: skip
    parser.add_argument("--input-grad", action="store_true",
                        help="the input gradient's GEMM forms instead")  # fmt: skip
    args = parser.parse_args()
    if args.merge < 0 or args.rows < 1 or args.rounds < 1:
        parser.error("--merge is 0 (off) or more, --rows and --rounds at least 1")
    if args.input_grad:
        input_grad(args.rows, args.rounds)
        return
    if not gemm.available():
        raise SystemExit("nn/gemm: numpy's OpenBLAS sgemm is not found here; nothing to compare")
    if args.merge:
        merged(args.merge, args.rows, args.rounds)
        return
    rng = np.random.default_rng(0)
    print(f"rows = {args.rows}; {'weight':<8} {'in-place ms':>11} {'numpy ms':>9} {'speed-up':>9}"
          f" {'roofline ms':>11} {'of roofline':>11}")  # fmt: skip
    totals = {True: 0.0, False: 0.0, "roof": 0.0}
    for name, (n_in, n_out) in SHAPES.items():
        layer, grads = _linear(n_in, n_out)
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


def merged(k: int, rows: int, rounds: int) -> None:
    """K separate in-place W GEMMs of `rows` rows against one of K x rows after the gather."""
    rng = np.random.default_rng(0)
    print(f"{k} x {rows} rows    separate ms  merged GEMM ms  gather ms  merged ms"
          "  merged/separate")  # fmt: skip
    totals = np.zeros(4)
    for name, (n_in, n_out) in SHAPES.items():
        layer, _ = _linear(n_in, n_out)
        xs = [rng.standard_normal((rows, n_in)).astype(np.float32) for _ in range(k)]
        dys = [rng.standard_normal((rows, n_out)).astype(np.float32) for _ in range(k)]
        times: dict[str, list[float]] = {"separate": [], "gemm": [], "gather": []}
        for _ in range(rounds + 1):
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


def input_grad(rows: int, rounds: int) -> None:
    """dy @ W^T over the model's weights in each form, and W^T's refresh, median ms."""
    rng = np.random.default_rng(0)
    shapes = [SHAPES[n] for n in ("qkv", "proj", "up", "down")] * 4 + [SHAPES["head"]]
    ws = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    wts = [np.ascontiguousarray(w.T) for w in ws]
    dys = [rng.standard_normal((rows, o)).astype(np.float32) for _, o in shapes]

    def refresh() -> None:
        for w, wt in zip(ws, wts, strict=True):
            np.copyto(wt, w.T)

    forms = {
        "dy @ W^T (the layers')": lambda: [dy @ w.T for dy, w in zip(dys, ws, strict=True)],
        "dy @ a contiguous W^T": lambda: [dy @ wt for dy, wt in zip(dys, wts, strict=True)],
        "(W @ dy^T)^T, a view": lambda: [(w @ dy.T).T for dy, w in zip(dys, ws, strict=True)],
        "(W @ dy^T)^T, contiguous": lambda: [
            np.ascontiguousarray((w @ dy.T).T) for dy, w in zip(dys, ws, strict=True)
        ],
        "refresh every W^T": refresh,
    }
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds + 1):
        for name, fn in forms.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    ref = _median_ms(times["dy @ W^T (the layers')"])
    print(f"rows = {rows}; the input gradients of {len(shapes)} weights, median ms")
    for name, t in times.items():
        ms = _median_ms(t)
        vs = f"  ({ref / ms:.3f}x the layers' form)" if name != "refresh every W^T" else ""
        print(f"  {name:<26} {ms:8.3f}{vs}")
    same = all(np.array_equal(dy @ w.T, dy @ wt) for dy, w, wt in zip(dys, ws, wts, strict=True))
    print(f"  a contiguous W^T gives the same bits: {same}")


if __name__ == "__main__":
    main()
