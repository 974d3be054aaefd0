"""Token files in llm.c's format, read through numpy.memmap, and the windows a step trains on.

    header: 256 int32, little-endian: [20240520 (magic), 1 (version), token count, 0, ...]
    body:   `count` uint16 tokens

llm.c's `dev/data/*.py` scripts (tinyshakespeare, fineweb shards) and `mpihybrid data prepare`
write it. A data set is one file or a glob of shards; a window is seq_len + 1 consecutive tokens
inside one shard (x = its first T, y = its last T), numbered over all shards in sorted path order.
A rank reads only the windows it is given (the memmap pages them in), so a multi-GB corpus costs
no rank its size in memory.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np

from mpihybrid.files import atomic_path
from mpihybrid.inputs import InputFileError, open_regular

MAGIC, VERSION = 20240520, 1
HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
MAX_TOKENS = 2**31 - 1  # the header's count is an int32
SCAN_TOKENS = 1 << 24  # tokens read at once while looking for the largest one

# T = seq_len (tokens per training sequence)


class DataError(ValueError):
    """Data that cannot be trained on; the message is one line for the user."""


def write_tokens(path: str | os.PathLike, tokens: np.ndarray, overwrite: bool = False) -> None:
    """One token file, atomically (a temporary beside it, then a rename)."""
    tokens = np.asarray(tokens)
    if tokens.size > MAX_TOKENS:
        raise DataError(f"{path}: {tokens.size} tokens do not fit one file (at most {MAX_TOKENS})")
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
        raise DataError(f"{path}: tokens must fit uint16 (0..65535)")
    header = np.zeros(HEADER_INTS, "<i4")
    header[:3] = MAGIC, VERSION, tokens.size
    with atomic_path(path, overwrite) as tmp, open(tmp, "wb") as fh:
        fh.write(header.tobytes())
        fh.write(tokens.astype("<u2").tobytes())


def open_tokens(path: str | os.PathLike) -> np.memmap | np.ndarray:
    """The tokens of one file as a read-only memmap, its header checked against its size."""
    path = Path(path)
    try:  # a FIFO or a device: refused before it is opened
        with open_regular(path, what="token file") as (fh, size):
            header = np.frombuffer(fh.read(HEADER_BYTES), "<i4")
            count = _checked_count(path, header, size)
            if count == 0:
                return np.zeros(0, "<u2")
            # mapped through the file checked above (mmap keeps its own reference to it)
            return np.memmap(fh, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
    except InputFileError as exc:
        raise DataError(str(exc)) from None
    except OSError as exc:
        raise DataError(f"token file {path}: {exc.strerror or exc}") from None


def _checked_count(path: Path, header: np.ndarray, size: int) -> int:
    """The header's token count, checked against the file's size (DataError otherwise)."""
    if len(header) < 3:
        raise DataError(f"token file {path}: {size} bytes, shorter than the 1024-byte header")
    magic, version, count = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise DataError(
            f"token file {path}: magic number {magic}, expected {MAGIC} (not an llm.c token file)"
        )
    if version != VERSION:
        raise DataError(f"token file {path}: version {version}, this reader reads {VERSION}")
    if count < 0:
        raise DataError(f"token file {path}: header count {count} is negative")
    want = HEADER_BYTES + 2 * count
    if size != want:
        raise DataError(
            f"token file {path}: {size} bytes, but its header's count {count} needs "
            f"1024 + 2 * {count} = {want} (truncated, or not written by an llm.c-format writer)"
        )
    return count


def shard_paths(pattern: str, where: str) -> list[Path]:
    """A file, or a glob of shards (sorted); DataError when it names nothing."""
    if any(c in pattern for c in "*?["):
        # directories left out; a FIFO or a device matched is refused when opened
        found = sorted(Path(p) for p in glob.glob(pattern) if not Path(p).is_dir())
        if not found:
            raise DataError(f"{where} = {pattern!r}: no file matches")
        return found
    path = Path(pattern)
    if path.is_dir():
        raise DataError(f"{where} = {pattern!r} is a directory; name a token file or a glob")
    if not path.exists():
        raise DataError(f"{where} = {pattern!r}: no such file")
    return [path]


def max_token(tokens: np.ndarray) -> int:
    """The largest token, read in pieces (a memmap is never loaded whole)."""
    top = -1
    for lo in range(0, len(tokens), SCAN_TOKENS):
        top = max(top, int(tokens[lo : lo + SCAN_TOKENS].max()))
    return top


class TokenShards:
    """Every window of seq_len + 1 tokens in a file or glob of shards, numbered 0..num_windows-1
    shard by shard."""

    def __init__(self, pattern: str, seq_len: int, where: str = "data.train") -> None:
        self.pattern, self.seq_len, self.where = pattern, seq_len, where
        self.paths = shard_paths(pattern, where)
        self.shards = [open_tokens(p) for p in self.paths]
        per_shard = [max(len(s) - seq_len, 0) for s in self.shards]
        self.first_window = np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int64)
        self.num_windows = int(self.first_window[-1])
        self.num_tokens = sum(len(s) for s in self.shards)

    def windows(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x, y (len(index), T) int64: windows `index` (numbers over all shards)."""
        index = np.asarray(index, np.int64)
        shard = np.searchsorted(self.first_window, index, side="right") - 1
        rows = np.empty((len(index), self.seq_len + 1), np.int64)
        for i, (s, w) in enumerate(zip(shard, index, strict=True)):
            start = int(w - self.first_window[s])
            rows[i] = self.shards[s][start : start + self.seq_len + 1]
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])

    def check(self, vocab: int, batch: int) -> None:
        """DataError unless every token is < vocab and there is a whole batch of windows."""
        T = self.seq_len
        if self.num_windows == 0:
            longest = max(len(s) for s in self.shards)
            raise DataError(
                f"{self.where} = {self.pattern!r}: its longest shard has {longest} tokens, shorter "
                f"than one sequence of data.seq_len({T}) + 1 = {T + 1}"
            )
        if self.num_windows < batch:
            raise DataError(
                f"{self.where} = {self.pattern!r}: {self.num_windows} windows of {T + 1} tokens, "
                f"fewer than one global batch of train.global_batch({batch})"
            )
        for path, tokens in zip(self.paths, self.shards, strict=True):
            top = max_token(tokens) if len(tokens) else -1
            if top >= vocab:
                raise DataError(
                    f"token file {path} holds token {top} >= data.vocab({vocab}) (the model's "
                    "vocabulary); set data.vocab to the tokenizer's size"
                )
