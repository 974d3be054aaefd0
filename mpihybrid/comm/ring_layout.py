"""Where a ring cuts its vector: p chunks, each in segments (one message each), and every
segment's slot in a wire buffer.

    segments, wire_bytes = segment_layout(count, p, segment, cuts, codec.nbytes)
    lo, hi, offset, nbytes = segments[c][k]     # segment k of chunk c

Chunks have np.array_split bounds. A segment holds at most `segment` elements and also ends at
every cut (a weight gather's tensor boundaries: a lossy codec's blocks start at each segment, so
none then holds two tensors). Slots start on 8 bytes, so float views of a slot stay aligned.
With `origin`, segments start at origin + k * segment (and at the cuts) instead of at each
chunk's start: rings that cut one vector into different chunks (the two-level ring's nodes of
different sizes) then cut it into the same segments wherever their chunk bounds are cuts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

Segment = tuple[int, int, int, int]  # (lo, hi, wire offset, wire bytes)


def chunk_bounds(count: int, parts: int) -> np.ndarray:
    """Start offsets of `parts` chunks plus the end, like np.array_split: bounds[i]..bounds[i+1]."""
    base, extra = divmod(count, parts)
    i = np.arange(parts + 1)
    return i * base + np.minimum(i, extra)


def aligned(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def segment_layout(
    count: int,
    parts: int,
    segment: int,
    cuts: tuple[int, ...],
    nbytes: Callable[[int], int],
    *,
    origin: int | None = None,
) -> tuple[list[list[Segment]], int]:
    """Every chunk's segments, and the bytes a wire buffer of all of them takes; nbytes(n): what
    n elements take on the wire. origin: segments on a grid from there (module docstring)."""
    bounds = [int(b) for b in chunk_bounds(count, parts)]
    segments, offset = [], 0
    for c in range(parts):
        start, end = bounds[c], bounds[c + 1]
        first = start if origin is None else start + (origin - start) % segment
        grid = {start, *range(first, end, segment)} if end > start else set()
        edges = sorted(grid | {x for x in cuts if start < x < end})
        segs = []
        for lo, hi in itertools.pairwise([*edges, end]):
            segs.append((lo, hi, offset, nbytes(hi - lo)))
            offset += aligned(segs[-1][3])
        segments.append(segs)
    return segments, offset
