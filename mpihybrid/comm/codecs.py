"""Wire codecs for the gradient all-reduce: fp32 (raw), fp16, bf16, int8 with per-block scales.

    codec = get_codec("int8", block=256)
    wire = np.empty(codec.nbytes(len(x)), np.uint8)
    codec.encode(x, wire, residual)             # residual = x - decode(wire), in the same pass
    codec.decode_add(wire, len(x), acc)         # acc += decode(wire)

Every codec turns `count` float32 values into `nbytes(count)` bytes and back. A codec holds no
state that carries information from one call to the next: the error-feedback residual lives in
the all-reduce. Each call stands alone, so any slice of a vector can be encoded by itself.

Two implementations give the same bytes: the numpy references in this file (what the maths reads
like; a reference keeps scratch buffers, grown on demand and reused) and the numba kernels of
codec_kernels.py (one fused pass per operation, no allocation), which run when numba is installed
(`mpihybrid._numba`). `get_codec(name, kernels="numpy")` gives the references, as the tests use.
The references call the array module of their arguments (`device.array_module`), so given CuPy
arrays a codec runs on the GPU and only encoded bytes need to cross PCIe; the kernels take host
arrays.

Byte layouts (native byte order; every rank of a job shares one machine type):
    fp32  count * float32
    fp16  count * float16, IEEE round to nearest even: beyond +-65504 becomes inf; a NaN
          becomes a quiet NaN with its sign and the top 9 bits of its payload
    bf16  count * uint16, the upper half of the float32 bits rounded to nearest even; a NaN
          keeps its sign and top payload bits, with the quiet bit set
    int8  nblocks * float32 scales, then count * int8; nblocks = ceil(count / block),
          scale = absmax of the block, x ~= q * scale / 127 with q = rint(x * (127 / scale)).
          q = 0 for a block whose 127 / scale is not a finite positive float32: a zero block,
          one below 127 / FLT_MAX ~ 3.7e-37 (decodes to zeros), one holding inf (scale inf) or
          NaN (scale: the quiet NaN 0x7FC00000). The last two decode to NaN, which keeps
          divergence visible.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from mpihybrid import _numba
from mpihybrid.comm import codec_kernels
from mpihybrid.comm.device import array_module

# CODECS, the names a job may give (comm.codec, comm.p2p_codec): the registry's, at the end
KERNELS = ("auto", "numpy")  # auto: the numba kernels where numba is enabled
# the operations a codec may give a compiled kernel (its `_<operation>_fast` method)
_OPERATIONS = ("encode", "decode", "decode_add", "encode_feedback", "decode_add_feedback",
               "reduce_encode")  # fmt: skip


class Codec:
    """Base class: `name`, `lossy`, byte size, encode, decode and decode-add of float32 vectors.

    A subclass writes the numpy reference (`_encode_numpy`, `_decode_numpy`, `_decode_add_numpy`)
    and, optionally, the calls of its kernels (`_encode_fast`, `_decode_fast`, `_decode_add_fast`,
    the error-feedback forms `_encode_feedback_fast`, `_decode_add_feedback_fast`, the fused
    `_reduce_encode_fast`): an operation without a kernel runs its numpy reference.
    """

    name: str = ""
    lossy: bool = True

    def __init__(self, kernels: str = "auto") -> None:
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        compiled = kernels == "auto" and _numba.ENABLED
        self.kernels = frozenset(
            op for op in _OPERATIONS if compiled and hasattr(self, f"_{op}_fast")
        )
        self.fast = bool(self.kernels)
        self._scratch: dict[tuple[str, str], Any] = {}

    def nbytes(self, count: int) -> int:
        raise NotImplementedError

    def encode(
        self,
        x: np.ndarray,
        out: np.ndarray,
        residual: np.ndarray | None = None,
        add_residual: bool = False,
    ) -> None:
        """x: float32 1-D; out: uint8 1-D of length nbytes(len(x)); residual (float32, len(x)),
        when given, receives the encoding error x - decode(out) (error feedback).
        add_residual: encode x + residual instead (the last call's error joins the input in the
        same pass; x is left as it is) and keep the new error in `residual`."""
        _check(x, np.float32, len(x), "x")
        _check(out, np.uint8, self.nbytes(len(x)), "out")
        if residual is not None:
            _check(residual, np.float32, len(x), "residual")
        elif add_residual:
            raise ValueError("add_residual needs a residual")
        if add_residual and self._kernel_for("encode_feedback", x):
            self._encode_feedback_fast(x, out, residual)
            return
        if not add_residual and self._kernel_for("encode", x):
            self._encode_fast(x, out, residual)
            return
        if add_residual:  # the reference: the sum first, then its encoding
            total = self._buffer("feedback", np.float32, len(x), x)
            array_module(x).add(x, residual, out=total)
            x = total
        self._encode_numpy(x, out)
        if residual is not None:
            self._decode_numpy(out, len(x), residual)
            array_module(x).subtract(x, residual, out=residual)

    def decode(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        """buf: uint8 1-D of length nbytes(count); out: float32 1-D of length count."""
        _check(buf, np.uint8, self.nbytes(count), "buf")
        _check(out, np.float32, count, "out")
        if self._kernel_for("decode", out):
            self._decode_fast(buf, out)
        else:
            self._decode_numpy(buf, count, out)

    def decode_add(
        self, buf: np.ndarray, count: int, out: np.ndarray, residual: np.ndarray | None = None
    ) -> None:
        """out += decode(buf), the reduce-scatter hot path; with `residual`,
        out = (out + residual) + decode(buf) in one pass (error feedback)."""
        _check(buf, np.uint8, self.nbytes(count), "buf")
        _check(out, np.float32, count, "out")
        if residual is not None:
            _check(residual, np.float32, count, "residual")
        if residual is not None and self._kernel_for("decode_add_feedback", out):
            self._decode_add_feedback_fast(buf, out, residual)
            return
        if residual is None and self._kernel_for("decode_add", out):
            self._decode_add_fast(buf, out)
            return
        if residual is not None:
            out += residual
        self._decode_add_numpy(buf, count, out)

    def reduce_encode(
        self, buf: np.ndarray, x: np.ndarray, out: np.ndarray, residual: np.ndarray | None = None
    ) -> None:
        """The ring owner's last reduce-scatter hop and its all-gather encoding, in one call:
        decode_add(buf, len(x), x, residual), encode(x, out, residual), decode(out, len(x), x).
        Afterwards x holds exactly what every other replica will decode from `out`, and
        `residual` (when given) this rank's new encoding error. The kernels do it in one pass."""
        count = len(x)
        _check(buf, np.uint8, self.nbytes(count), "buf")
        _check(x, np.float32, count, "x")
        _check(out, np.uint8, self.nbytes(count), "out")
        if residual is not None:
            _check(residual, np.float32, count, "residual")
        if self._kernel_for("reduce_encode", x):
            self._reduce_encode_fast(buf, x, out, residual)
            return
        self.decode_add(buf, count, x, residual)
        self.encode(x, out, residual)
        self.decode(out, count, x)

    def _kernel_for(self, operation: str, array: Any) -> bool:
        """Whether `operation` runs its compiled kernel: the codec has one, numba is on, and the
        array is on the host (device arrays take the array-module code)."""
        return operation in self.kernels and array_module(array) is np

    def _decode_add_numpy(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        tmp = self._buffer("f32", np.float32, count, out)
        self._decode_numpy(buf, count, tmp)
        out += tmp

    def _buffer(self, key: str, dtype: type, n: int, like: Any) -> Any:
        """A reusable scratch array of `n` elements where `like` lives (grown, never shrunk)."""
        xp = array_module(like)
        buf = self._scratch.get((xp.__name__, key))
        if buf is None or len(buf) < n:
            buf = self._scratch[xp.__name__, key] = xp.empty(n, dtype)
        return buf[:n]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'' if self.fast else 'kernels=numpy'})"


def _check(a: np.ndarray, dtype: type, length: int, what: str) -> None:
    """A kernel trusts its arguments: wrong lengths would write past the end, so refuse them."""
    if a.dtype != dtype or a.ndim != 1 or len(a) != length or not a.flags.c_contiguous:
        raise ValueError(
            f"{what}: expected a contiguous 1-D {np.dtype(dtype)} array of length {length}, "
            f"got {a.dtype} {a.shape}"
        )


class Fp32Codec(Codec):
    """Raw float32: already one pass (a copy or an add), so numpy is the fast path too."""

    name, lossy = "fp32", False

    def nbytes(self, count: int) -> int:
        return 4 * count

    def encode(
        self,
        x: np.ndarray,
        out: np.ndarray,
        residual: np.ndarray | None = None,
        add_residual: bool = False,
    ) -> None:
        if add_residual:
            if residual is None:
                raise ValueError("add_residual needs a residual")
            _check(residual, np.float32, len(x), "residual")
            _check(out, np.uint8, self.nbytes(len(x)), "out")
            array_module(x).add(x, residual, out=out.view(np.float32))
        else:
            super().encode(x, out)
        if residual is not None:
            _check(residual, np.float32, len(x), "residual")
            residual[:] = 0  # lossless (x - x would turn inf and NaN into NaN)

    def _encode_numpy(self, x: np.ndarray, out: np.ndarray) -> None:
        out.view(np.float32)[:] = x

    def _decode_numpy(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        out[:] = buf.view(np.float32)

    def _decode_add_numpy(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        out += buf.view(np.float32)

    def _encode_fast(self, x: np.ndarray, out: np.ndarray, residual: np.ndarray | None) -> None:
        self._encode_numpy(x, out)

    def _decode_fast(self, buf: np.ndarray, out: np.ndarray) -> None:
        self._decode_numpy(buf, len(out), out)

    def _decode_add_fast(self, buf: np.ndarray, out: np.ndarray) -> None:
        self._decode_add_numpy(buf, len(out), out)

    def _decode_add_feedback_fast(self, buf: np.ndarray, out: np.ndarray, residual) -> None:
        out += residual
        out += buf.view(np.float32)


class _KernelCodec(Codec):
    """A codec whose fast path is codec_kernels.<family>_<operation>(..., kernel_arg)."""

    family = ""

    @property
    def kernel_arg(self) -> int:
        raise NotImplementedError

    @functools.cached_property
    def _k(self):
        """The family's kernels, looked up once (the ring calls them every chunk)."""
        ops = ("encode", "decode", "decode_add", "encode_feedback", "decode_add_feedback",
               "reduce_encode")  # fmt: skip
        return SimpleNamespace(**{op: getattr(codec_kernels, f"{self.family}_{op}") for op in ops})

    def _encode_fast(self, x: np.ndarray, out: np.ndarray, residual: np.ndarray | None) -> None:
        self._k.encode(x, out, residual, self.kernel_arg)

    def _decode_fast(self, buf: np.ndarray, out: np.ndarray) -> None:
        self._k.decode(buf, out, self.kernel_arg)

    def _decode_add_fast(self, buf: np.ndarray, out: np.ndarray) -> None:
        self._k.decode_add(buf, out, self.kernel_arg)

    def _encode_feedback_fast(self, x: np.ndarray, out: np.ndarray, residual) -> None:
        self._k.encode_feedback(x, out, residual, self.kernel_arg)

    def _decode_add_feedback_fast(self, buf: np.ndarray, out: np.ndarray, residual) -> None:
        self._k.decode_add_feedback(buf, out, residual, self.kernel_arg)

    def _reduce_encode_fast(self, buf, x, out, residual) -> None:
        self._k.reduce_encode(buf, x, residual, out, self.kernel_arg)


class _HalfCodec(_KernelCodec):
    """fp16 and bf16: two bytes a value; their kernels are codec_kernels.half_<operation> with
    the format's `kind` (codec_kernels.BF16 or FP16)."""

    family, kind = "half", -1

    @property
    def kernel_arg(self) -> int:
        return self.kind

    def nbytes(self, count: int) -> int:
        return 2 * count


class Fp16Codec(_HalfCodec):
    name, lossy, kind = "fp16", True, codec_kernels.FP16

    def _encode_numpy(self, x: np.ndarray, out: np.ndarray) -> None:
        with np.errstate(over="ignore"):  # past +-65504 is inf, on purpose
            out.view(np.float16)[:] = x
        # NaN: numpy's cast keeps the payload or quiets it depending on its build; fix one rule
        xp = array_module(x)
        if len(x) and xp.isnan(x.max()):  # max propagates NaN: one pass, no mask in the usual case
            nan = xp.isnan(x)
            bits = x.view(np.uint32)[nan]
            half = ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)
            out.view(np.uint16)[nan] = half.astype(np.uint16)

    def _decode_numpy(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        out[:] = buf.view(np.float16)


class Bf16Codec(_HalfCodec):
    name, lossy, kind = "bf16", True, codec_kernels.BF16

    def _encode_numpy(self, x: np.ndarray, out: np.ndarray) -> None:
        bits = x.view(np.uint32)
        # round to nearest even: add 0x7FFF plus the lowest kept bit, then drop 16 bits.
        # Infinities stay infinite; a finite value past the bf16 range rounds to inf as in IEEE.
        xp = array_module(x)
        t = self._buffer("u32", np.uint32, len(x), x)
        xp.right_shift(bits, 16, out=t)
        t &= 1
        t += 0x7FFF
        t += bits
        t >>= 16
        out16 = out.view(np.uint16)
        xp.copyto(out16, t, casting="unsafe")
        # NaN payloads could carry into the exponent and become inf: keep them quiet NaNs
        if len(x) and xp.isnan(x.max()):  # max propagates NaN: one pass, no mask in the usual case
            nan = xp.isnan(x)
            out16[nan] = (bits[nan] >> 16).astype(np.uint16) | 0x0040

    def _decode_numpy(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        u32 = out.view(np.uint32)
        array_module(out).copyto(u32, buf.view(np.uint16), casting="unsafe")
        u32 <<= 16


class Int8Codec(_KernelCodec):
    """Blockwise absmax int8: error per element <= scale / 254 (half a quantisation step)."""

    name, lossy, family = "int8", True, "int8"

    @property
    def kernel_arg(self) -> int:
        return self.block

    def __init__(self, block: int = 256, kernels: str = "auto") -> None:
        super().__init__(kernels)
        if block < 1:
            raise ValueError(f"int8 block size must be >= 1, got {block}")
        self.block = block

    def __repr__(self) -> str:
        return f"Int8Codec(block={self.block}{'' if self.fast else ', kernels=numpy'})"

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

    def _encode_numpy(self, x: np.ndarray, out: np.ndarray) -> None:
        count = len(x)
        scales, q = self._split(out, count)
        if count == 0:
            return
        # scales = per-block absmax
        xp = array_module(x)
        work = self._buffer("f32", np.float32, count, x)
        xp.abs(x, out=work)
        full, tail = self._blocks(work)
        nfull = len(full)
        xp.max(full, axis=1, out=scales[:nfull])
        if len(tail):
            scales[nfull] = tail.max()
        scales[xp.isnan(scales)] = np.nan  # one NaN, whichever payload max() met first
        # factor = 127 / scale, and 0 where that is not a finite positive number (zero, tiny,
        # infinite or NaN scale): those blocks get q = 0 and their scale tells the decoder
        factor = self._buffer("factor", np.float32, len(scales), x)
        with np.errstate(divide="ignore", over="ignore"):
            xp.divide(np.float32(127), scales, out=factor)
        ok = (factor > 0) & (factor < np.inf)
        factor[~ok] = 0
        xfull, xtail = self._blocks(x)
        wfull, wtail = self._blocks(work)
        with np.errstate(invalid="ignore"):  # inf * 0 = NaN, set to 0 below
            xp.multiply(xfull, factor[:nfull, None], out=wfull)
            if len(tail):
                xp.multiply(xtail, factor[nfull], out=wtail)
        if not ok.all():
            xp.nan_to_num(work, copy=False, nan=0.0, posinf=0.0, neginf=0.0)  # inf * 0
        xp.rint(work, out=work)
        xp.copyto(q, work, casting="unsafe")

    def _decode_numpy(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        scales, q = self._split(buf, count)
        if count == 0:
            return
        xp = array_module(out)
        step = self._buffer("step", np.float32, len(scales), out)
        qfull, qtail = self._blocks(q)
        ofull, otail = self._blocks(out)
        nfull = len(qfull)
        with np.errstate(invalid="ignore", over="ignore"):  # a NaN or inf scale: NaN, on purpose
            xp.divide(scales, np.float32(127), out=step)
            xp.multiply(qfull, step[:nfull, None], out=ofull)
            if len(qtail):
                xp.multiply(qtail, step[nfull], out=otail)


# The registry: name -> what makes one from (block, kernels). A new codec is a Codec subclass
# (a module of its own, or here) and one entry here; config, the rings, the pipeline wire,
# bench allreduce and predict's calibration read the names from CODECS.
REGISTRY: dict[str, Callable[[int, str], Codec]] = {
    "fp32": lambda block, kernels: Fp32Codec(kernels),
    "fp16": lambda block, kernels: Fp16Codec(kernels),
    "bf16": lambda block, kernels: Bf16Codec(kernels),
    "int8": lambda block, kernels: Int8Codec(block, kernels),
}
CODECS = tuple(REGISTRY)


def get_codec(name: str, block: int = 256, kernels: str = "auto") -> Codec:
    """A fresh codec by name; `block` is the int8 block size (ignored by the others);
    kernels="numpy" forces the numpy references (what the tests compare the kernels with)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown codec {name!r}; known codecs: {', '.join(CODECS)}")
    return REGISTRY[name](block, kernels)


def overflow_hint(name: str) -> str:
    """What a non-finite gradient after a ring with this codec may come from ("" for none):
    fp16 turns a finite element past its range into inf on the wire."""
    if name != "fp16":
        return ""
    return (
        "comm.codec = fp16 holds only |x| <= 65504 and turns a larger gradient element into "
        "inf on the wire; bf16 keeps float32's range (3.4e38) in the same 2 bytes: "
        "--set comm.codec=bf16"
    )
