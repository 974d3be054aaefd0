"""Datasets and deterministic sharding.

Every task draws step s's global batch from the step number alone, so every rank (and the
one-process reference) sees the same samples without any communication.

The teacher task (mlp): X ~ N(0, 1) with `features` columns, y = [X . w_true > 0], w_true a
hidden random vector; step s's global batch is a fixed slice of an epoch-wise permutation.
Token tasks (gpt): see TokenTask (synthetic) and TextTask (token files, nn/tokens.py). Every
task is sharded the same way:

    global batch (B rows) -> dp shards of B/dp rows -> M micro-batches of B/(dp*M) rows
"""

from __future__ import annotations

import numpy as np

from mpihybrid.nn.tokenizer import check_one_tokenizer, load_tokenizer, tokenizer_beside
from mpihybrid.nn.tokens import DataError, TokenShards

# B = global batch, F = features, T = tokens per sequence


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


def heldout(task, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` held-out samples: a synthetic task's first ones (fewer when it has fewer)."""
    if hasattr(task, "heldout"):
        return task.heldout(count)
    return task.test_x[:count], task.test_y[:count]


def replica_microbatches(
    task, step: int, batch: int, dp_rank: int, dp_size: int, *, num_microbatches: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """My replica's M micro-batches of step `step`; a task with `rows` (token files) reads only
    my shard's windows, the others draw the global batch and cut it."""
    if hasattr(task, "rows"):
        shard = batch // dp_size
        x, y = task.rows(step, batch, dp_rank * shard, (dp_rank + 1) * shard)
        return microbatches(x, y, 0, 1, num_microbatches)
    x, y = task.global_batch(step, batch)
    return microbatches(x, y, dp_rank, dp_size, num_microbatches)


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


class TokenTask:
    """Next-token prediction on sequences of `seq_len` tokens (gpt).

    x = tokens 0..T-1 of a sequence, y = tokens 1..T. `global_batch(step, B)` draws B fresh
    sequences from the step number; the held-out sequences come from a stream of their own.

    random-tokens: every token uniform over the vocabulary -- for throughput; nothing to learn
        (the best possible loss is ln V).
    markov: a fixed random first-order Markov chain where every token has `branching`
        equally likely successors: the loss can fall from ln V (unigram entropy, the chain's
        tokens are nearly uniform) to its entropy rate ln(branching) -- proof that training
        learns.
    """

    def __init__(
        self,
        kind: str,
        vocab: int,
        seq_len: int,
        test_samples: int,
        seed: int,
        *,
        branching: int = 2,
    ) -> None:
        self.kind, self.vocab, self.seq_len, self.seed = kind, vocab, seq_len, seed
        self.in_features, self.num_classes = seq_len, vocab
        self.successors = None
        if kind == "markov":
            rng = np.random.default_rng([seed, 0])
            self.successors = np.stack(
                [rng.choice(vocab, size=branching, replace=False) for _ in range(vocab)]
            )
            self.entropy_rate = float(np.log(branching))
        else:
            self.entropy_rate = float(np.log(vocab))
        self.test_x, self.test_y = self._sequences(np.random.default_rng([seed, 2]), test_samples)

    def _sequences(self, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
        if self.successors is None:
            seq = rng.integers(0, self.vocab, size=(count, self.seq_len + 1))
        else:
            seq = np.empty((count, self.seq_len + 1), np.int64)
            seq[:, 0] = rng.integers(0, self.vocab, size=count)
            picks = rng.integers(0, self.successors.shape[1], size=(count, self.seq_len))
            for t in range(self.seq_len):
                seq[:, t + 1] = self.successors[seq[:, t], picks[:, t]]
        return np.ascontiguousarray(seq[:, :-1]), np.ascontiguousarray(seq[:, 1:])

    def global_batch(self, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
        return self._sequences(np.random.default_rng([self.seed, 1, step]), batch)


class TextTask:
    """Next-token prediction on windows of token files (data.kind = "tokens").

    Step s's global batch is B windows of data.train drawn uniformly (with replacement) from
    np.random.default_rng([seed, 1, s]) over all shards: the step alone says which, so every
    replica (and the one-process reference) reads the same ones, each only its own shard's.
    Held-out windows are evenly spaced over data.val, the same ones at every evaluation.
    """

    def __init__(self, cfg) -> None:
        self.seq_len, self.seed, self.vocab = cfg.seq_len, cfg.seed, cfg.vocab
        self.in_features, self.num_classes = cfg.seq_len, cfg.vocab
        self.train = TokenShards(cfg.train, cfg.seq_len, "data.train")
        self.val = TokenShards(cfg.val, cfg.seq_len, "data.val")
        beside = tokenizer_beside(cfg.train)
        self.tokenizer = load_tokenizer(beside) if beside.is_file() else None
        self.bytes_per_token = self.tokenizer.bytes_per_token if self.tokenizer else None
        self.test_samples = cfg.test_samples
        self._test = None

    def _test_set(self) -> tuple[np.ndarray, np.ndarray]:
        """What the final accuracy is measured on, read when first asked for."""
        if self._test is None:
            self._test = self.heldout(self.test_samples)
        return self._test

    test_x = property(lambda self: self._test_set()[0])
    test_y = property(lambda self: self._test_set()[1])

    def starts(self, step: int, batch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1, step])
        return rng.integers(0, self.train.num_windows, batch)

    def global_batch(self, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
        return self.train.windows(self.starts(step, batch))

    def rows(self, step: int, batch: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows lo..hi-1 of step `step`'s global batch, reading only their windows."""
        return self.train.windows(self.starts(step, batch)[lo:hi])

    def heldout(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """`count` windows of data.val, evenly spaced (repeated only when it has fewer)."""
        index = np.linspace(0, self.val.num_windows - 1, count).round().astype(np.int64)
        return self.val.windows(index)

    def check(self, global_batch: int) -> None:
        """DataError unless both splits fit the model and hold a global batch of windows, and
        the tokenizer beside the data fits the model's vocabulary, and every shard comes from one
        tokenizer (check_one_tokenizer)."""
        if self.tokenizer is not None and self.tokenizer.vocab > self.vocab:
            raise DataError(
                f"the tokenizer beside data.train has {self.tokenizer.vocab} tokens but "
                f"data.vocab = {self.vocab}: set data.vocab = {self.tokenizer.vocab}"
            )
        self.train.check(self.vocab, global_batch)
        self.val.check(self.vocab, global_batch)
        check_one_tokenizer([self.train, self.val])


def check_data(data, global_batch: int) -> None:
    """Open and check the job's token files ([data], DataError, one line) for batches of
    `global_batch` sequences; other kinds need nothing."""
    if data.kind == "tokens":
        TextTask(data).check(global_batch)


def build_task(cfg) -> TeacherTask | TokenTask | TextTask:
    if cfg.kind == "teacher":
        return TeacherTask(cfg.features, cfg.train_samples, cfg.test_samples, cfg.seed)
    if cfg.kind in ("random-tokens", "markov"):
        return TokenTask(
            cfg.kind, cfg.vocab, cfg.seq_len, cfg.test_samples, cfg.seed, branching=cfg.branching
        )
    if cfg.kind == "tokens":
        return TextTask(cfg)
    raise ValueError(f"data.kind = {cfg.kind!r}: unknown")


def task_dims(cfg) -> tuple[int, int]:
    """(in_features, num_classes) of the model this data feeds, without drawing any data."""
    if cfg.kind == "teacher":
        return cfg.features, TeacherTask.num_classes
    return cfg.seq_len, cfg.vocab
