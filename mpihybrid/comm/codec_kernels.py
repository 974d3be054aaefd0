"""numba kernels of the wire codecs: one fused pass per operation, byte-identical to codecs.py.

    from mpihybrid.comm import codec_kernels as k
    k.int8_encode(x, out, residual, block)   # residual: float32 array or None
    k.int8_decode_add(buf, out, block)
    k.int8_encode_feedback(x, out, residual, block)      # encodes x + residual (error feedback)
    k.int8_decode_add_feedback(buf, out, residual, block)  # out = (out + residual) + decode
    k.int8_reduce_encode(buf, x, residual, out, block)   # the two above and decode, fused

codecs.py holds the numpy references (what the maths reads like) and calls these when
`_numba.ENABLED`; the tests compare the two byte for byte. Every kernel works on float32 as its
uint32 bits where that vectorises better (absolute value = bits & 0x7FFFFFFF, which orders like
the floats, NaN above inf), writes into the caller's buffers and allocates nothing.
No fastmath: the bytes must be those of IEEE float32 arithmetic, operation by operation.
"""

from __future__ import annotations

import numpy as np

from mpihybrid._numba import njit

ABS_MASK = np.uint32(0x7FFFFFFF)
INF_BITS = np.uint32(0x7F800000)
QNAN_BITS = np.uint32(0x7FC00000)


# --- int8: nblocks float32 scales, then count int8 values ---------------------------------
# Loops run over per-block slices from index 0: numba then knows the index is not negative,
# drops its wraparound check and LLVM vectorises (about 4x on this machine). np.rint rounds
# ties to even, as numpy's rint in the reference, in one vector instruction.


@njit(error_model="numpy")  # 127 / 0 is inf, not ZeroDivisionError
def _int8_scale(m, scale_bits, scales, b):
    """Block b's scale from m, the largest sign-cleared bits of its values (an integer max,
    which vectorises and orders like the floats, NaN above inf): (factor, step, ok), where
    q = rint(x * factor), decoded q * step, and not ok means q = 0 (zero, NaN, infinite or too
    small to invert: the scale tells which)."""
    scale_bits[b] = QNAN_BITS if m > INF_BITS else m  # any NaN: the one quiet NaN
    scale = scales[b]
    factor = np.float32(127) / scale
    return factor, scale / np.float32(127), factor > 0 and factor < np.inf


@njit(error_model="numpy")
def int8_encode(x, out, residual, block):
    """Encode x; with residual, its error too (from the integer: q = 0 decodes to +0)."""
    n = len(x)
    nblocks = (n + block - 1) // block
    scale_bits = out[: 4 * nblocks].view(np.uint32)
    scales = out[: 4 * nblocks].view(np.float32)
    q = out[4 * nblocks :].view(np.int8)
    bits = x.view(np.uint32)
    for b in range(nblocks):
        lo, hi = b * block, min(b * block + block, n)
        xb, bb, qb = x[lo:hi], bits[lo:hi], q[lo:hi]
        m = np.uint32(0)
        for i in range(len(bb)):
            m = max(m, np.uint32(bb[i] & ABS_MASK))
        factor, step, ok = _int8_scale(m, scale_bits, scales, b)
        if residual is not None:
            rb = residual[lo:hi]
            if ok:
                for i in range(len(xb)):
                    v = np.int32(np.rint(np.float32(xb[i] * factor)))  # in [-127, 127]
                    qb[i] = np.int8(v)
                    rb[i] = xb[i] - np.float32(v) * step
            else:
                for i in range(len(xb)):
                    qb[i] = 0
                    rb[i] = xb[i] - np.float32(0) * step
        elif ok:
            for i in range(len(xb)):
                qb[i] = np.int8(np.int32(np.rint(np.float32(xb[i] * factor))))
        else:
            qb[:] = 0


@njit(error_model="numpy")
def int8_encode_feedback(x, out, residual, block):
    """Encode x + residual and keep the new error in residual, one block at a time: the sum is
    formed in registers twice (the block's absmax, then its values), never stored, so the loops
    stay free of aliasing and vectorise (x is left as it is)."""
    n = len(x)
    nblocks = (n + block - 1) // block
    scale_bits = out[: 4 * nblocks].view(np.uint32)
    scales = out[: 4 * nblocks].view(np.float32)
    q = out[4 * nblocks :].view(np.int8)
    for b in range(nblocks):
        lo, hi = b * block, min(b * block + block, n)
        xb, rb, qb = x[lo:hi], residual[lo:hi], q[lo:hi]
        m = np.uint32(0)
        for i in range(len(xb)):
            t = np.float32(xb[i] + rb[i])
            m = max(m, np.uint32(t.view(np.uint32) & ABS_MASK))
        factor, step, ok = _int8_scale(m, scale_bits, scales, b)
        if ok:
            for i in range(len(xb)):
                t = np.float32(xb[i] + rb[i])
                v = np.int32(np.rint(np.float32(t * factor)))  # in [-127, 127]
                qb[i] = np.int8(v)
                rb[i] = t - np.float32(v) * step  # from the integer: q = 0 decodes to +0
        else:  # zero, NaN, infinite or too small to invert: q = 0, the error is all of it
            for i in range(len(xb)):
                qb[i] = 0
                rb[i] = np.float32(xb[i] + rb[i]) - np.float32(0) * step


@njit
def int8_decode(buf, out, block):
    _int8_decode(buf, out, block, False)


@njit
def int8_decode_add(buf, out, block):
    _int8_decode(buf, out, block, True)


@njit
def _int8_decode(buf, out, block, add):
    n = len(out)
    nblocks = (n + block - 1) // block
    scales = buf[: 4 * nblocks].view(np.float32)
    q = buf[4 * nblocks :].view(np.int8)
    for b in range(nblocks):
        lo, hi = b * block, min(b * block + block, n)
        qb, ob = q[lo:hi], out[lo:hi]
        step = scales[b] / np.float32(127)
        if add:
            for i in range(len(ob)):
                ob[i] += np.float32(qb[i]) * step
        else:
            for i in range(len(ob)):
                ob[i] = np.float32(qb[i]) * step


@njit
def int8_decode_add_feedback(buf, out, residual, block):
    """out = (out + residual) + decode(buf), one pass."""
    n = len(out)
    nblocks = (n + block - 1) // block
    scales = buf[: 4 * nblocks].view(np.float32)
    q = buf[4 * nblocks :].view(np.int8)
    for b in range(nblocks):
        lo, hi = b * block, min(b * block + block, n)
        qb, ob, rb = q[lo:hi], out[lo:hi], residual[lo:hi]
        step = scales[b] / np.float32(127)
        for i in range(len(ob)):
            ob[i] = (ob[i] + rb[i]) + np.float32(qb[i]) * step


@njit(error_model="numpy")
def int8_reduce_encode(buf, x, residual, out, block):
    """The owner's last reduce-scatter hop in one pass per block (the block stays in L1):
    x = (x + residual) + decode(buf), then x is encoded into out, its error goes to residual,
    and x becomes decode(out). residual None: no error feedback. The same float operations, in
    the same order, as decode_add, encode and decode one after another."""
    n = len(x)
    nblocks = (n + block - 1) // block
    scales_in = buf[: 4 * nblocks].view(np.float32)
    q_in = buf[4 * nblocks :].view(np.int8)
    scale_bits = out[: 4 * nblocks].view(np.uint32)
    scales = out[: 4 * nblocks].view(np.float32)
    q = out[4 * nblocks :].view(np.int8)
    for b in range(nblocks):
        lo, hi = b * block, min(b * block + block, n)
        xb, qib, qb = x[lo:hi], q_in[lo:hi], q[lo:hi]
        step_in = scales_in[b] / np.float32(127)
        m = np.uint32(0)  # the sum's absmax, taken as it is stored
        if residual is not None:
            rb = residual[lo:hi]
            for i in range(len(xb)):
                t = np.float32((xb[i] + rb[i]) + np.float32(qib[i]) * step_in)
                xb[i] = t
                m = max(m, np.uint32(t.view(np.uint32) & ABS_MASK))
        else:
            for i in range(len(xb)):
                t = np.float32(xb[i] + np.float32(qib[i]) * step_in)
                xb[i] = t
                m = max(m, np.uint32(t.view(np.uint32) & ABS_MASK))
        factor, step, ok = _int8_scale(m, scale_bits, scales, b)
        if residual is not None:
            rb = residual[lo:hi]
            if ok:
                for i in range(len(xb)):
                    t = xb[i]
                    v = np.int32(np.rint(np.float32(t * factor)))  # in [-127, 127]
                    qb[i] = np.int8(v)
                    d = np.float32(v) * step  # from the integer: q = 0 decodes to +0
                    rb[i] = t - d
                    xb[i] = d
            else:
                for i in range(len(xb)):
                    qb[i] = 0
                    d = np.float32(0) * step
                    rb[i] = xb[i] - d
                    xb[i] = d
        elif ok:
            for i in range(len(xb)):
                v = np.int32(np.rint(np.float32(xb[i] * factor)))
                qb[i] = np.int8(v)
                xb[i] = np.float32(v) * step
        else:
            for i in range(len(xb)):
                qb[i] = 0
                xb[i] = np.float32(0) * step


# --- bf16: the upper half of the float32 bits, rounded to nearest even --------------------
# numba widens uint32 arithmetic to 64 bits; np.uint32(...) around each result keeps the
# vectors 8 lanes wide


@njit
def _bf16_bits(b):
    rounded = np.uint32(b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16
    quiet_nan = (b >> 16) | np.uint32(0x0040)  # NaN: sign and top payload, quiet bit set
    return np.uint16(quiet_nan if np.uint32(b & ABS_MASK) > INF_BITS else rounded)


@njit
def _bf16_value(h):
    return np.uint32(np.uint32(h) << 16).view(np.float32)


# --- fp16: IEEE binary16, round to nearest even ------------------------------------------
# float32 -> float16 after M. Dukhan's FP16 library (fp16_ieee_from_fp32_value): the FPU does
# the rounding in every range, with no branch; 2.5x faster here than integer rounding with
# selects per range (F. Giesen's float_to_half_fast3_rtne), for the same bytes


@njit
def _fp16_bits(b):
    a = np.uint32(b & ABS_MASK)
    # |x| * 2**112 * 2**-110 = 4|x|, but what is past the half range overflows to inf on the way
    big = np.float32(a.view(np.float32) * np.float32(2.0**112))
    base = np.float32(big * np.float32(2.0**-110))
    # adding 2**(e + 15) (e: the exponent of |x|, at least -14 so that subnormal halves round at
    # 2**-24) rounds 4|x| to the half's 11 bits, ties to even; its low bits are then the half's
    bias = max(np.uint32(np.uint32(a << 1) & np.uint32(0xFF000000)), np.uint32(0x71000000))
    magic = np.uint32((bias >> 1) + np.uint32(0x07800000)).view(np.float32)
    o = np.float32(magic + base).view(np.uint32)
    h = np.uint32((o >> 13) & np.uint32(0x7C00)) + np.uint32(o & np.uint32(0x0FFF))
    quiet_nan = np.uint32(0x7E00) | ((a >> 13) & np.uint32(0x3FF))  # top payload bits kept
    h = quiet_nan if a > INF_BITS else h
    return np.uint16(h | (np.uint32(b >> 16) & np.uint32(0x8000)))


@njit
def _fp16_value(h):
    h = np.uint32(h)
    o = np.uint32((h & np.uint32(0x7FFF)) << 13)
    e = o & np.uint32(0x0F800000)
    o = np.uint32(o + np.uint32(0x38000000))  # rebias 15 -> 127
    # inf or NaN: exponent all ones, payload kept
    special = np.uint32(o + np.uint32(0x38000000))
    # zero or subnormal: renormalise with an exact float subtract
    tiny = np.float32(np.uint32(o + np.uint32(0x00800000)).view(np.float32) - np.float32(2**-14))
    o = special if e == np.uint32(0x0F800000) else o
    o = tiny.view(np.uint32) if e == 0 else o
    return np.uint32(o | np.uint32((h & np.uint32(0x8000)) << 16)).view(np.float32)


# --- the two half formats' passes, written once: `kind` is BF16 or FP16, the same for every
# element, so LLVM takes the branch out of each loop (a loop a function keeps that simple)
BF16, FP16 = 0, 1


@njit
def _half_bits(b, kind):
    return _bf16_bits(b) if kind == BF16 else _fp16_bits(b)


@njit
def _half_value(h, kind):
    return _bf16_value(h) if kind == BF16 else _fp16_value(h)


@njit
def half_encode(x, out, residual, kind):
    bits = x.view(np.uint32)
    out16 = out.view(np.uint16)
    if residual is None:
        for i in range(len(x)):
            out16[i] = _half_bits(bits[i], kind)
    else:
        for i in range(len(x)):
            h = _half_bits(bits[i], kind)
            out16[i] = h
            residual[i] = x[i] - _half_value(h, kind)


@njit
def half_encode_feedback(x, out, residual, kind):
    out16 = out.view(np.uint16)
    for i in range(len(x)):
        t = np.float32(x[i] + residual[i])
        h = _half_bits(t.view(np.uint32), kind)
        out16[i] = h
        residual[i] = t - _half_value(h, kind)


@njit
def half_decode_add_feedback(buf, out, residual, kind):
    in16 = buf.view(np.uint16)
    for i in range(len(out)):
        out[i] = (out[i] + residual[i]) + _half_value(in16[i], kind)


@njit
def half_reduce_encode(buf, x, residual, out, kind):
    """x = (x + residual) + decode(buf); encode x, its error to residual; x = decode(out)."""
    in16, out16 = buf.view(np.uint16), out.view(np.uint16)
    if residual is not None:
        _half_reduce_feedback(in16, x, residual, out16, kind)
    else:
        _half_reduce(in16, x, out16, kind)


@njit
def _half_reduce_feedback(in16, x, residual, out16, kind):
    for i in range(len(x)):
        t = np.float32((x[i] + residual[i]) + _half_value(in16[i], kind))
        h = _half_bits(t.view(np.uint32), kind)
        out16[i] = h
        d = _half_value(h, kind)
        residual[i] = t - d
        x[i] = d


@njit
def _half_reduce(in16, x, out16, kind):
    for i in range(len(x)):
        t = np.float32(x[i] + _half_value(in16[i], kind))
        h = _half_bits(t.view(np.uint32), kind)
        out16[i] = h
        x[i] = _half_value(h, kind)


@njit
def half_decode(buf, out, kind):
    in16 = buf.view(np.uint16)
    for i in range(len(out)):
        out[i] = _half_value(in16[i], kind)


@njit
def half_decode_add(buf, out, kind):
    in16 = buf.view(np.uint16)
    for i in range(len(out)):
        out[i] += _half_value(in16[i], kind)
