"""The head's loss in cache-sized pieces: the softmax cross-entropy of one micro-batch's logits
(rows x vocab) as forward, correct and backward over the whole matrix (the reference), against
`SoftmaxCrossEntropy.step` (the three in one, each piece of rows through every pass while it
is in cache: what training runs) at its default piece and others, and against the head's three
GEMMs of the same shape (forward, input gradient, weight gradient).

    OMP_NUM_THREADS=1 python benchmarks/loss_chunks.py                 # gpt_bench: 128 x 10000
    OMP_NUM_THREADS=1 python benchmarks/loss_chunks.py --vocab 50257

Before each timed loss the head's forward GEMM writes the logits afresh (untimed; the loss works
in place), so every variant starts from the caches the head leaves it, as in training. The runs
are interleaved round by round (a drifting machine moves them together). Printed: median ms of
each, its speed-up over the reference, and the loss's share of the head and loss together.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mpihybrid.nn.loss import PIECE_BYTES, SoftmaxCrossEntropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--hidden", type=int, default=240)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows, vocab, hidden = args.rows, args.vocab, args.hidden
    x = (rng.standard_normal((rows, hidden)) / hidden**0.25).astype(np.float32)
    w = (rng.standard_normal((hidden, vocab)) / hidden**0.25).astype(np.float32)
    dw = np.zeros_like(w)
    targets = rng.integers(0, vocab, rows)
    work = np.empty((rows, vocab), dtype=np.float32)
    loss = SoftmaxCrossEntropy()

    def reference():
        _, cache = loss.forward(work, targets)
        loss.correct(cache)
        loss.backward(cache, 0.25)

    def pieces(size: int):
        return lambda: loss.step(work, targets, 0.25, size)

    def head_gemms():
        y = x @ w
        _ = y @ w.T
        dw[...] += x.T @ y

    default = max(1, PIECE_BYTES // (vocab * 4))
    runs = {"gemms": head_gemms, "reference": reference}
    sizes = sorted({default, 1, 4, 16, 64, rows})
    runs.update({f"step {n}": pieces(n) for n in sizes})
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds + 1):
        for name, fn in runs.items():
            np.matmul(x, w, out=work)  # the head's logits, as the loss finds them in training
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}
    gemms = ms.pop("gemms")
    whole = ms.pop("reference")
    print(f"logits {rows} x {vocab}; the head's three GEMMs {gemms:.3f} ms")
    share = whole / (whole + gemms)
    print(f"  reference (whole)        {whole:7.3f} ms  ({share:.1%} of head + loss)")
    for name, t in ms.items():
        size = int(name.split()[1])
        mark = "  (default: PIECE_BYTES)" if size == default else ""
        print(f"  step, {size:>4}-row pieces  {t:7.3f} ms  ({whole / t:.2f}x the reference){mark}")


if __name__ == "__main__":
    main()
