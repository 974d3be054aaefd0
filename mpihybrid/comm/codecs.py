"""Wire codecs for the gradient all-reduce: fp32 (raw), fp16, bf16, int8 with per-block scales.

    codec = get_codec("int8", block=256)
    wire = np.empty(codec.nbytes(len(x)), np.uint8)
    codec.encode(x, wire); codec.decode_add(wire, len(x), acc)   # acc += decode(wire)

Every codec turns `count` float32 values into `nbytes(count)` bytes and back. A codec holds no
state that carries information from one call to the next: the error-feedback residual lives in
the all-reduce. It only keeps scratch buffers, grown on demand and reused, so that the hot path
(`encode`, `decode_add`) does not allocate.

Byte layouts (native byte order; every rank of a job shares one machine type):
    fp32  count * float32
    fp16  count * float16 (IEEE casting: beyond +-65504 becomes inf)
    bf16  count * uint16, the upper half of the float32 bits rounded to nearest even
    int8  nblocks * float32 scales, then count * int8; nblocks = ceil(count / block),
          scale = absmax of the block, x ~= q * scale / 127 with q = rint(x / scale * 127)
"""

from __future__ import annotations

import numpy as np

CODECS = ("fp32", "fp16", "bf16", "int8")


class Codec:
    """Base class: `name`, `lossy`, byte size, encode, decode and decode-add of float32 vectors."""

    name: str = ""
    lossy: bool = True

    def __init__(self) -> None:
        self._scratch: dict[str, np.ndarray] = {}

    def nbytes(self, count: int) -> int:
        raise NotImplementedError

    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        """x: float32 1-D; out: uint8 1-D of length nbytes(len(x))."""
        raise NotImplementedError

    def decode(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        """buf: uint8 1-D of length nbytes(count); out: float32 1-D of length count."""
        raise NotImplementedError

    def decode_add(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        """out += decode(buf), the reduce-scatter hot path."""
        raise NotImplementedError

    def _buffer(self, key: str, dtype: type, n: int) -> np.ndarray:
        """A reusable scratch array of `n` elements (grown, never shrunk)."""
        buf = self._scratch.get(key)
        if buf is None or len(buf) < n:
            buf = self._scratch[key] = np.empty(n, dtype)
        return buf[:n]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Fp32Codec(Codec):
    name, lossy = "fp32", False

    def nbytes(self, count: int) -> int:
        return 4 * count

    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        out.view(np.float32)[:] = x

    def decode(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        out[:] = buf.view(np.float32)

    def decode_add(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        out += buf.view(np.float32)


class Fp16Codec(Codec):
    name, lossy = "fp16", True

    def nbytes(self, count: int) -> int:
        return 2 * count

    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        out.view(np.float16)[:] = x

    def decode(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        out[:] = buf.view(np.float16)

    def decode_add(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        out += buf.view(np.float16)


class Bf16Codec(Codec):
    name, lossy = "bf16", True

    def nbytes(self, count: int) -> int:
        return 2 * count

    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        bits = x.view(np.uint32)
        # round to nearest even: add 0x7FFF plus the lowest kept bit, then drop 16 bits.
        # Infinities stay infinite; a finite value past the bf16 range rounds to inf as in IEEE.
        t = self._buffer("u32", np.uint32, len(x))
        np.right_shift(bits, 16, out=t)
        t &= 1
        t += 0x7FFF
        t += bits
        t >>= 16
        out16 = out.view(np.uint16)
        np.copyto(out16, t, casting="unsafe")
        # NaN payloads could carry into the exponent and become inf: keep them quiet NaNs
        if len(x) and np.isnan(x.max()):  # max propagates NaN: one pass, no mask in the usual case
            nan = np.isnan(x)
            out16[nan] = (bits[nan] >> 16).astype(np.uint16) | 0x0040

    def decode(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        u32 = out.view(np.uint32)
        np.copyto(u32, buf.view(np.uint16), casting="unsafe")
        u32 <<= 16

    def decode_add(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        tmp = self._buffer("f32", np.float32, count)
        self.decode(buf, count, tmp)
        out += tmp


class Int8Codec(Codec):
    """Blockwise absmax int8: error per element <= scale / 254 (half a quantisation step)."""

    name, lossy = "int8", True

    def __init__(self, block: int = 256) -> None:
        super().__init__()
        if block < 1:
            raise ValueError(f"int8 block size must be >= 1, got {block}")
        self.block = block

    def __repr__(self) -> str:
        return f"Int8Codec(block={self.block})"

    def num_blocks(self, count: int) -> int:
        return -(-count // self.block)

    def nbytes(self, count: int) -> int:
        return 4 * self.num_blocks(count) + count

    def _split(self, buf: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        nblocks = self.num_blocks(count)
        return buf[: 4 * nblocks].view(np.float32), buf[4 * nblocks :].view(np.int8)

    def _blocks(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(full blocks as a 2-D view, the tail as a 1-D view) of a 1-D array."""
        nfull = len(a) // self.block
        return a[: nfull * self.block].reshape(nfull, self.block), a[nfull * self.block :]

    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        count = len(x)
        scales, q = self._split(out, count)
        if count == 0:
            return
        # scales = per-block absmax
        work = self._buffer("f32", np.float32, count)
        np.abs(x, out=work)
        full, tail = self._blocks(work)
        nfull = len(full)
        np.max(full, axis=1, out=scales[:nfull])
        if len(tail):
            scales[nfull] = tail.max()
        # factor = 127 / scale; a zero block gets 0 (all-zero q), a non-finite one too:
        # its scale (inf or NaN) then decodes the whole block to NaN, which keeps divergence visible
        factor = self._buffer("factor", np.float32, len(scales))
        ok = np.isfinite(scales) & (scales > 0)
        np.divide(np.float32(127), scales, out=factor, where=ok)
        factor[~ok] = 0
        xfull, xtail = self._blocks(x)
        wfull, wtail = self._blocks(work)
        np.multiply(xfull, factor[:nfull, None], out=wfull)
        if len(tail):
            np.multiply(xtail, factor[nfull], out=wtail)
        if not ok.all():
            np.nan_to_num(work, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        np.rint(work, out=work)
        np.copyto(q, work, casting="unsafe")

    def _step(self, scales: np.ndarray) -> np.ndarray:
        step = self._buffer("step", np.float32, len(scales))
        np.divide(scales, np.float32(127), out=step)
        return step

    def decode(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        scales, q = self._split(buf, count)
        if count == 0:
            return
        step = self._step(scales)
        qfull, qtail = self._blocks(q)
        ofull, otail = self._blocks(out)
        nfull = len(qfull)
        np.multiply(qfull, step[:nfull, None], out=ofull)
        if len(qtail):
            np.multiply(qtail, step[nfull], out=otail)

    def decode_add(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        tmp = self._buffer("f32", np.float32, count)
        self.decode(buf, count, tmp)
        out += tmp


def get_codec(name: str, block: int = 256) -> Codec:
    """A fresh codec by name; `block` is the int8 block size (ignored by the others)."""
    if name == "fp32":
        return Fp32Codec()
    if name == "fp16":
        return Fp16Codec()
    if name == "bf16":
        return Bf16Codec()
    if name == "int8":
        return Int8Codec(block)
    raise ValueError(f"unknown codec {name!r}; known codecs: {', '.join(CODECS)}")
