"""The weight gradient's GEMM accumulated in place: g += x^T @ dy as one sgemm with beta = 1.

    accumulate_xt_dy(g, x, dy)      # g (in, out) += x (rows, in)^T @ dy (rows, out)
    x, dy = gather(xs, dys)         # k micro-batches' rows, each list concatenated (merged W)

numpy's `g += x.T @ dy` writes x^T dy to a fresh (in, out) array, then reads it and g again and
writes g: a temporary as large as the weight and a pass over it after every GEMM. BLAS's sgemm
adds into C itself (C = alpha A B + beta C), but numpy does not pass beta, so this calls the sgemm
of the OpenBLAS that numpy bundles (found by `_blas.openblas_path`) through ctypes. Where that
library or its sgemm is not found (numpy built on another BLAS), or an array is not a float32
host array with unit inner stride, the numpy expression runs instead (the tested reference). The
sum is the same GEMM's, added once: bit-identical to the reference where one BLAS block covers
the rows, within float32 rounding otherwise (docs/performance.md).

A merged W (Stage.backward_weight_merged) gathers k micro-batches' x and dy rows into ONE
process-wide float32 scratch that every Linear of every stage of the process shares (the compute
runs on one thread): its size is the largest gather seen, one layer's, kept between steps so a
step allocates nothing. Buffers per layer would keep one pair per Linear alive (17 on a GPT
stage of 4 layers and the head), the shared one only the largest (scratch_bytes()).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

ENABLED = True  # False: always numpy's expression (benchmarks/gemm_ab.py times the two paths)
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS's enums
# the sgemm symbol and its integer width: numpy's wheels bundle scipy-openblas (64-bit ints,
# prefixed names); a system OpenBLAS has the plain 32-bit one
_SYMBOLS = (
    ("scipy_cblas_sgemm64_", ctypes.c_int64),
    ("cblas_sgemm64_", ctypes.c_int64),
    ("scipy_cblas_sgemm", ctypes.c_int),
    ("cblas_sgemm", ctypes.c_int),
)


@functools.cache
def _sgemm():
    """numpy's OpenBLAS cblas_sgemm, typed, or None."""
    from mpihybrid._blas import openblas_path

    path = openblas_path()
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path)  # numpy loaded it already: the same library and its threads
    except OSError:
        return None
    for name, integer in _SYMBOLS:
        fn = getattr(lib, name, None)
        if fn is not None:
            c_int, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
            fn.argtypes = [c_int, c_int, c_int, integer, integer, integer, f, p, integer, p,
                           integer, f, p, integer]  # fmt: skip
            fn.restype = None
            return fn
    return None


def available() -> bool:
    """Whether the in-place sgemm is found (else every call takes the numpy expression)."""
    return _sgemm() is not None


def _rows_ok(a) -> bool:
    return (
        type(a) is np.ndarray
        and a.dtype == np.float32
        and a.ndim == 2
        and a.strides[1] == 4
        and a.strides[0] % 4 == 0
        and a.strides[0] >= 4 * a.shape[1]
    )


def accumulate_xt_dy(g: np.ndarray, x: np.ndarray, dy: np.ndarray) -> None:
    """g += x^T @ dy for x (rows, in), dy (rows, out), g (in, out), in place. g may be a
    transposed view (a tied head's gradient is the embedding's, transposed): then g^T += dy^T x."""
    sgemm = _sgemm() if ENABLED else None
    if sgemm is None or len(x) == 0 or not (_rows_ok(x) and _rows_ok(dy)):
        g += x.T @ dy
    elif _rows_ok(g) and g.strides[0] == 4 * g.shape[1]:
        _xt_dy(sgemm, g, x, dy)
    elif _rows_ok(g.T) and g.T.strides[0] == 4 * g.shape[0]:
        _xt_dy(sgemm, g.T, dy, x)
    else:
        g += x.T @ dy


def _address(a: np.ndarray) -> int:
    # not a.ctypes.data: that object holds a cycle back to the array, so every call would leave
    # garbage for the cycle collector (tests/test_soak.py sees it as memory growing per step)
    return a.__array_interface__["data"][0]


def _xt_dy(sgemm, c: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """c (m, n), contiguous, += a (k, m)^T @ b (k, n)."""
    m, n, k = c.shape[0], c.shape[1], a.shape[0]
    sgemm(_ROW_MAJOR, _TRANS, _NO_TRANS, m, n, k, 1.0, _address(a), a.strides[0] // 4,
          _address(b), b.strides[0] // 4, 1.0, _address(c), n)  # fmt: skip


_scratch = np.empty(0, np.float32)  # gather's, grown to the largest gather and kept


def gatherable(a) -> bool:
    """Whether gather takes the array: a float32 numpy array (any strides; it is copied)."""
    return type(a) is np.ndarray and a.dtype == np.float32 and a.ndim == 2


def gather(xs: list[np.ndarray], dys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(the xs' rows concatenated, the dys' rows concatenated), both contiguous views of the
    process's scratch: valid until the next gather (the caller's GEMM uses them at once)."""
    global _scratch
    rows, n_in, n_out = sum(len(x) for x in xs), xs[0].shape[1], dys[0].shape[1]
    need = rows * (n_in + n_out)
    if _scratch.size < need:
        _scratch = np.empty(0, np.float32)  # the old one freed before the new one is made
        _scratch = np.empty(need, np.float32)
    x = _scratch[: rows * n_in].reshape(rows, n_in)
    dy = _scratch[rows * n_in : need].reshape(rows, n_out)
    np.concatenate(xs, out=x)
    np.concatenate(dys, out=dy)
    return x, dy


def scratch_bytes() -> int:
    """Bytes the merged W's gather scratch holds now (0 before the first merged W)."""
    return _scratch.nbytes
