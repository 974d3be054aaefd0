"""Event rows grouped by integer columns with one sort per column, never one mask per group:
what keeps trace analysis linear in the events.

    keys, group = groups(rows["step"], rows["rank"]); group_sum(group, durations(rows), len(keys))
"""

from __future__ import annotations

import numpy as np


def durations(events: np.ndarray) -> np.ndarray:
    return events["end"] - events["start"]


def groups(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows grouped by the integer columns, one 1-D sort per column (no mask per group): the
    distinct keys (a row each, in key order) and every row's group index."""
    n = len(columns[0])
    index = np.zeros(n, dtype=np.int64)
    for column in columns:  # (groups so far) x (this column), made dense again: never overflows
        values, dense = np.unique(np.asarray(column, dtype=np.int64), return_inverse=True)
        _, index = np.unique(index * len(values) + dense.reshape(-1), return_inverse=True)
        index = index.reshape(-1)
    first = np.full(int(index.max()) + 1 if n else 0, n, dtype=np.int64)
    np.minimum.at(first, index, np.arange(n))
    distinct = np.stack([np.asarray(c, dtype=np.int64)[first] for c in columns], axis=1)
    return distinct.reshape(len(first), len(columns)), index


def group_sum(index: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(index, weights=values, minlength=n).astype(np.float64)


def group_min(index: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, np.inf)
    np.minimum.at(out, index, values)
    return out


def group_max(index: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, -np.inf)
    np.maximum.at(out, index, values)
    return out
