"""What fusing the head's loss into cache-sized pieces could buy: the softmax cross-entropy of
one micro-batch's logits (rows x vocab) whole, against the same rows in pieces of R rows, and
against the head's three GEMMs of the same shape (forward, input gradient, weight gradient).

    OMP_NUM_THREADS=1 python benchmarks/loss_chunks.py                 # gpt_bench: 128 x 10000
    OMP_NUM_THREADS=1 python benchmarks/loss_chunks.py --vocab 50257

Each round copies the logits into the working array (the loss works in place), then runs
forward, correct and backward; the copy's own time is printed and taken out. Printed: median ms
of each, and the loss's share of the head and loss together.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mpihybrid.nn.layers import SoftmaxCrossEntropy


def _median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--hidden", type=int, default=240)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows, vocab, hidden = args.rows, args.vocab, args.hidden
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, rows)
    work = np.empty_like(logits)
    loss = SoftmaxCrossEntropy()

    def pieces(size: int):
        def run():
            np.copyto(work, logits)
            for i in range(0, rows, size):
                _, cache = loss.forward(work[i : i + size], targets[i : i + size])
                loss.correct(cache)
                loss.backward(cache, 0.25)

        return run

    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = rng.standard_normal((hidden, vocab)).astype(np.float32)
    dw = np.zeros_like(w)

    def head_gemms():
        y = x @ w
        _ = y @ w.T
        dw[...] += x.T @ y

    copy = _median_ms(lambda: np.copyto(work, logits), args.rounds)
    gemms = _median_ms(head_gemms, args.rounds)
    print(f"logits {rows} x {vocab}; the head's three GEMMs {gemms:.3f} ms")
    whole = _median_ms(pieces(rows), args.rounds) - copy
    print(
        f"  loss whole            {whole:7.3f} ms  ({whole / (whole + gemms):.1%} of head + loss)"
    )
    for size in (64, 32, 16, 8):
        t = _median_ms(pieces(size), args.rounds) - copy
        print(f"  loss in {size:>3}-row pieces {t:7.3f} ms  ({whole / t:.2f}x the whole)")


if __name__ == "__main__":
    main()
