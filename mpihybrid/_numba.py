"""numba where it is installed: the compiled fast path that sits beside every numpy reference.

    from mpihybrid import _numba
    @_numba.njit
    def encode_kernel(x, out): ...              # compiled on first call, cached on disk
    if _numba.ENABLED: encode_kernel(x, out)   # else: the numpy reference

numba is the `fast` extra (`pip install 'mpihybrid[fast]'`), not a core dependency: it follows
new Python and numpy releases a few months late, and every kernel has a numpy reference that reads
like the maths and is what the tests compare the kernels with. `MPIHYBRID_KERNELS` chooses:
    auto   (default) numba when it imports, else numpy
    numpy  the references only (what a student reads; what a benchmark compares against)
    numba  numba or an error at import
Kernels release the GIL (`nogil`), so a communication thread can encode while the main thread
computes, and run on one thread (a rank owns its cores; BLAS threads are set in _threads).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

CHOICES = ("auto", "numpy", "numba")
CHOICE = os.environ.get("MPIHYBRID_KERNELS", "auto").strip().lower() or "auto"
if CHOICE not in CHOICES:
    raise ImportError(f"MPIHYBRID_KERNELS={CHOICE!r}: choose one of {', '.join(CHOICES)}")

try:
    import numba
except ImportError:  # the numpy references run instead
    numba = None
    if CHOICE == "numba":
        raise ImportError(
            "MPIHYBRID_KERNELS=numba but numba is not installed: pip install 'mpihybrid[fast]'"
        ) from None

ENABLED = numba is not None and CHOICE != "numpy"


def njit(fn: Callable | None = None, **options) -> Callable:
    """numba.njit(cache=True, nogil=True, **options) when numba is installed; otherwise the
    function itself, uncompiled (callers take the numpy reference unless ENABLED)."""

    def wrap(f: Callable) -> Callable:
        if numba is None:
            return f
        return numba.njit(cache=True, nogil=True, **options)(f)

    return wrap if fn is None else wrap(fn)


def describe() -> str:
    """One line for reports: which kernels run."""
    if ENABLED:
        return f"numba {numba.__version__}"
    return "numpy (numba not installed)" if numba is None else "numpy (MPIHYBRID_KERNELS=numpy)"


# the modules whose kernels a training run compiles on its first step
KERNEL_MODULES = ("mpihybrid.nn.kernels", "mpihybrid.comm.codec_kernels")


def kernels_cached() -> bool:
    """Whether numba's disk cache holds compiled kernels of every KERNEL_MODULES module (its
    index files, beside the source or under NUMBA_CACHE_DIR): if not, the first step compiles
    them, for about half a minute."""
    import importlib.util

    roots = [Path(os.environ["NUMBA_CACHE_DIR"])] if os.environ.get("NUMBA_CACHE_DIR") else []
    for name in KERNEL_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        source = Path(spec.origin)
        places = [source.parent / "__pycache__", *roots]
        if not any(next(p.rglob(f"{source.stem}.*.nbi"), None) for p in places if p.is_dir()):
            return False
    return True
