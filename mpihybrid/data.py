"""Datasets and deterministic sharding.

The teacher task: X ~ N(0, 1) with `features` columns, y = [X . w_true > 0], w_true a hidden random
vector. Step s's global batch is a fixed slice of an epoch-wise permutation, so every rank (and the
one-process reference) sees the same samples without any communication:

    global batch (B rows) -> dp shards of B/dp rows -> M micro-batches of B/(dp*M) rows
"""

from __future__ import annotations

import numpy as np

# B = global batch, F = features


class TeacherTask:
    num_classes = 2

    def __init__(self, features: int, train_samples: int, test_samples: int, seed: int):
        rng = np.random.default_rng([seed, 0])
        self.w_true = rng.standard_normal(features)
        x = rng.standard_normal((train_samples + test_samples, features)).astype(np.float32)
        y = (x.astype(np.float64) @ self.w_true > 0).astype(np.int64)
        self.train_x, self.test_x = x[:train_samples], x[train_samples:]
        self.train_y, self.test_y = y[:train_samples], y[train_samples:]
        self.in_features = features
        self.seed = seed

    def global_batch(self, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of step `step`: epochs are fresh permutations; a batch never straddles two."""
        per_epoch = len(self.train_x) // batch
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng([self.seed, 1, epoch]).permutation(len(self.train_x))
        rows = np.sort(order[index * batch : (index + 1) * batch])
        return self.train_x[rows], self.train_y[rows]


def microbatches(
    x: np.ndarray, y: np.ndarray, dp_rank: int, dp_size: int, num_microbatches: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """My replica's shard of a global batch, cut into M equal contiguous micro-batches."""
    shard = len(x) // dp_size
    xs = x[dp_rank * shard : (dp_rank + 1) * shard]
    ys = y[dp_rank * shard : (dp_rank + 1) * shard]
    mb = shard // num_microbatches
    return [
        (np.ascontiguousarray(xs[i * mb : (i + 1) * mb]), ys[i * mb : (i + 1) * mb])
        for i in range(num_microbatches)
    ]


def build_task(cfg) -> TeacherTask:
    if cfg.kind != "teacher":
        raise ValueError(f"data.kind = {cfg.kind!r}: unknown")
    return TeacherTask(cfg.features, cfg.train_samples, cfg.test_samples, cfg.seed)
