"""The softmax cross-entropy loss a model's last stage computes: forward, correct and backward
over the whole logits matrix (the reference, in place), and `step`, the three in one in
cache-sized pieces of rows, what training runs (the same bits).

    loss, right, dlogits = SoftmaxCrossEntropy().step(logits, targets, scale=1 / M)
"""

from __future__ import annotations

import numpy as np

from mpihybrid.comm.device import array_module


def _rows(a: np.ndarray) -> np.ndarray:
    """(..., C) -> (B, C) without copying."""
    return a.reshape(-1, a.shape[-1])


# the logits of one piece of `SoftmaxCrossEntropy.step`: within a core's L2 (1-2 MiB on the
# hosts measured) with room for the head's weights streaming past
PIECE_BYTES = 1 << 20


class SoftmaxCrossEntropy:
    """Mean cross-entropy of softmax(logits (..., K)) against integer targets (...).

    Works in place: `forward` turns the logits it is given into exp(logits - row max) (a GPT's
    logits are the largest array of a step) and `backward` turns those into the gradient,
    normalising and scaling in one pass, so call `correct` before `backward`. `step` is the
    three in one, in cache-sized pieces of rows: what training runs.
    """

    def forward(self, logits: np.ndarray, targets: np.ndarray) -> tuple[float, object]:
        xp = array_module(logits)
        exps = _rows(logits)
        t = targets.reshape(-1)
        # no numba kernel: numpy's vectorised exp beats a fused pass here (kernels.py)
        rows = xp.arange(exps.shape[0])
        # subtracting the row max keeps exp() from overflowing; softmax is unchanged by it
        exps -= exps.max(axis=1, keepdims=True)
        target_logit = exps[rows, t]
        np.exp(exps, out=exps)
        total = exps.sum(axis=1, keepdims=True)
        loss = float(np.mean(np.log(total[:, 0]) - target_logit))
        return loss, (exps, total, t, logits.shape)

    def backward(self, cache: object, scale: float = 1.0) -> np.ndarray:
        """Gradient of `scale * loss` with respect to the logits (overwrites the cache):
        (softmax - onehot) * scale / rows."""
        exps, total, t, shape = cache
        per_row = exps.dtype.type(scale / t.shape[0])
        np.divide(per_row, total, out=total)
        dlogits = np.multiply(exps, total, out=exps)
        dlogits[array_module(exps).arange(t.shape[0]), t] -= per_row
        return dlogits.reshape(shape)

    def step(
        self, logits: np.ndarray, targets: np.ndarray, scale: float = 1.0, piece: int = 0
    ) -> tuple[float, int, np.ndarray]:
        """`forward`, `correct` and `backward` in one: (the mean loss, the rows right, the
        gradient of `scale * loss` in place of the logits), the same bits. On the host it runs
        in pieces of `piece` rows (0: as many as fit PIECE_BYTES), each piece's passes (max,
        exp, sum, argmax, the gradient) one after another while the piece is in the core's
        cache, where the whole matrix goes to memory and back for each of them
        (benchmarks/loss_chunks.py); on a GPU whole."""
        flat = _rows(logits)
        rows, classes = flat.shape
        if array_module(logits) is not np:
            loss, cache = self.forward(logits, targets)
            return loss, self.correct(cache), self.backward(cache, scale)
        t = targets.reshape(-1)
        piece = piece or max(1, PIECE_BYTES // (classes * flat.itemsize))
        per_row = flat.dtype.type(scale / rows)
        losses = np.empty(rows, dtype=flat.dtype)
        right = 0
        for start in range(0, rows, piece):
            part, pt = flat[start : start + piece], t[start : start + piece]
            at = np.arange(len(pt))
            part -= part.max(axis=1, keepdims=True)
            target_logit = part[at, pt]
            np.exp(part, out=part)
            total = part.sum(axis=1, keepdims=True)
            right += int(np.count_nonzero(part.argmax(axis=1) == pt))
            np.subtract(np.log(total[:, 0]), target_logit, out=losses[start : start + piece])
            np.divide(per_row, total, out=total)
            np.multiply(part, total, out=part)
            part[at, pt] -= per_row
        return float(np.mean(losses)), right, flat.reshape(logits.shape)

    def correct(self, cache: object) -> int:
        """Rows whose largest logit is the target's (before `backward`)."""
        exps, _, t, _ = cache
        return int(np.count_nonzero(exps.argmax(axis=1) == t))

    def nats(self, logits: np.ndarray, targets: np.ndarray) -> float:
        """Sum over rows of -log softmax(logits)[target] in float64, the logits untouched (the
        held-out loss: train/evaluate.py sums it over pieces)."""
        flat = _rows(logits).astype(np.float64)
        t = targets.reshape(-1)
        top = flat.max(axis=1)
        lse = np.log(np.exp(flat - top[:, None]).sum(axis=1)) + top
        return float(np.sum(lse - flat[np.arange(len(t)), t]))
