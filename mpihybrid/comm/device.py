"""Where a rank's arrays live (numpy on the CPU, CuPy on one GPU) and how MPI reaches them.

    backend = select_backend(grid.device, grid.cuda_aware, world)   # collective, every rank
    y = backend.zeros((b, C), np.float32)
    req = comm.Isend([backend.mpi_send_buffer(y, key), MPI.FLOAT], dest=peer, tag=tag)
    req = comm.Irecv([backend.mpi_recv_buffer(x, key), MPI.FLOAT], source=peer, tag=tag)
    req.Wait(); backend.finish_recv(x, key)                          # x now holds the message

One rank per GPU: a rank uses GPU local_rank % gpus_on_node, its rank among the ranks on its node
(MPI_Comm_split_type SHARED: no launcher variable needed). CUDA-aware MPI reads and writes device
memory itself, so arrays go to MPI as they are; any other MPI gets host staging: a send copies the
array into a host buffer, a receive lands in one and finish_recv copies it to the device. Staging
buffers are persistent, one per (direction, key), allocated once and reused every step: no
allocation in the step loop, and a buffer stays put while its non-blocking request is in flight
(reuse a key only after that request completed). MPI knows nothing of CUDA streams, so the current
stream is synchronized before MPI touches a buffer (as in mpi4py's CuPy demo).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from mpihybrid.comm.agree import agree

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda")
CUPY_MISSING = "grid.device = 'cuda' needs CuPy: pip install 'mpihybrid[cuda]'"
# Launch switches for an MPI library's CUDA support: hints of what was asked for, not built in.
CUDA_ENV_HINTS = (
    "MPICH_GPU_SUPPORT_ENABLED",  # Cray MPICH: 1 turns GPU support on (off by default)
    "MPIR_CVAR_ENABLE_GPU",  # MPICH: 0 turns GPU support off
    "MV2_USE_CUDA",  # MVAPICH2(-GDR)
    "OMPI_MCA_opal_cuda_support",  # Open MPI (smcuda path); UCX builds ignore it
)


def array_module(a) -> ModuleType:
    """numpy, or the module of a device array (cupy), like cupy.get_array_module."""
    if isinstance(a, (np.ndarray, np.generic)) and type(a).__module__ == "numpy":
        return np
    return sys.modules[type(a).__module__]


def host_array(a, out: np.ndarray | None = None) -> np.ndarray:
    """`a` as a host numpy array: itself when it is one (unless `out` is given), else a copy."""
    if array_module(a) is np:
        if out is None:
            return a
        np.copyto(out, a)
        return out
    return a.get(out=out)


def copy_from_host(dst, src: np.ndarray) -> None:
    """dst[...] = src, for a numpy or device `dst` (contiguous) and a host `src`."""
    if array_module(dst) is np:
        np.copyto(dst, src)
    else:
        dst.set(np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape))


class DeviceError(ValueError):
    """Bad device setup; a one-line message for the user (the CLI exits with status 2)."""


@dataclass
class Backend:
    name: str  # "cpu" or "cuda"
    xp: ModuleType  # numpy or cupy
    device_id: int | None  # the GPU this rank uses; None on cpu
    cuda_aware: bool  # MPI reads and writes device buffers directly
    staging: bool  # MPI sees host copies: cuda without cuda_aware (tests may force it on cpu)
    _staged: dict[tuple[str, Any], np.ndarray] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.name == "cuda" and not (self.cuda_aware or self.staging):
            raise ValueError("a cuda backend without CUDA-aware MPI needs staging=True")

    def empty(self, shape, dtype) -> Any:
        return self.xp.empty(shape, dtype)

    def zeros(self, shape, dtype) -> Any:
        return self.xp.zeros(shape, dtype)

    def asarray(self, host_array: np.ndarray) -> Any:
        """Host -> device (no copy on cpu); keep `host_array` unchanged until synchronize()."""
        return self.xp.asarray(host_array)

    def to_host(self, array, out: np.ndarray | None = None) -> np.ndarray:
        """Device -> host numpy (blocks until copied); on cpu `array` itself unless `out` given."""
        return host_array(array, out)

    def synchronize(self) -> None:
        """Wait for the work queued on the current CUDA stream; no-op on cpu."""
        if self.name == "cuda":
            self.xp.cuda.get_current_stream().synchronize()

    def _staging_buffer(self, direction: str, array, key) -> np.ndarray:
        buf = self._staged.get((direction, key))
        if buf is None:
            buf = self._staged[(direction, key)] = np.empty(array.shape, array.dtype)
        elif buf.shape != array.shape or buf.dtype != array.dtype:
            got = f"{array.dtype}{list(array.shape)}, not {buf.dtype}{list(buf.shape)}"
            raise ValueError(f"{direction} staging buffer {key!r}: got {got}")
        return buf

    def drop_staging(self, prefix: tuple) -> None:
        """Forget the staging buffers whose key starts with `prefix` (their owner is done)."""
        for direction, key in [k for k in self._staged if k[1][: len(prefix)] == prefix]:
            del self._staged[(direction, key)]

    def mpi_send_buffer(self, array, key) -> Any:
        """What MPI should send: `array` itself, or its persistent host copy for `key`."""
        self.synchronize()  # the kernels that wrote `array` must finish before MPI reads it
        if not self.staging:
            return array
        return self.to_host(array, out=self._staging_buffer("send", array, key))

    def mpi_recv_buffer(self, array, key) -> Any:
        """Where MPI should receive: `array` itself, or the persistent host buffer for `key`."""
        self.synchronize()  # earlier kernels (or copies) must be done with the buffer MPI writes
        if not self.staging:
            return array
        return self._staging_buffer("recv", array, key)

    def finish_recv(self, array, key) -> None:
        """After the receive completed: copy the staged message into `array` (no-op otherwise)."""
        if not self.staging:
            return
        # on a GPU the copy is queued on the current stream, ahead of the kernels that read it
        copy_from_host(array, self._staged[("recv", key)])

    def describe(self) -> str:
        where = "cpu" if self.device_id is None else f"{self.name}:{self.device_id}"
        mode = " (host staging)" if self.staging else " (CUDA-aware MPI)" if self.cuda_aware else ""
        return where + mode


CPU = Backend("cpu", np, None, cuda_aware=False, staging=False)  # numpy: MPI sees the arrays

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_host_memory(mmap_below: int = 32 << 20, trim_above: int = 1 << 30) -> bool:
    """Let glibc's malloc reuse freed memory instead of handing it back to the kernel.

    numpy allocates a fresh array for every temporary; with glibc's defaults each one of a
    megabyte or so is a new mmap (or the heap top is trimmed after it is freed), so every pass
    first page-faults its output in: a GELU over (128, 2048) floats took 1.2 ms instead of
    0.45 ms. Arrays below `mmap_below` bytes now come from the heap, which keeps up to
    `trim_above` bytes free for the next step. The process keeps its high-water mark, which a
    training step reaches every step anyway. Returns False where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_below) and mallopt(_M_TRIM_THRESHOLD, trim_above))


def local_rank(world: MPI.Comm) -> tuple[int, int]:
    """(my rank among the ranks on my node, ranks on my node); collective over `world`."""
    from mpi4py import MPI

    node_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    rank_size = node_comm.Get_rank(), node_comm.Get_size()
    node_comm.Free()
    return rank_size


def _memory_alloc_kinds() -> list[str] | None:
    """MPI 4.1's kinds for the World Model, e.g. ["mpi", "system", "cuda:device"]; None: unknown."""
    from mpi4py import MPI

    info = MPI.COMM_WORLD.Get_info()
    value = info.Get("mpi_memory_alloc_kinds")
    info.Free()
    return None if value is None else [k.strip() for k in value.split(",") if k.strip()]


def _query_cuda_support() -> int | None:
    """MPIX_Query_cuda_support() of the loaded MPI library (Open MPI, MPICH >= 4, MVAPICH2);
    None when it has no such function. mpi4py does not wrap this non-standard call."""
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    return int(query())


def detect_cuda_aware() -> bool | None:
    """True/False when the MPI library says so, else the launch environment's hint, else None.

    Yes if MPI_COMM_WORLD's MPI 4.1 info "mpi_memory_alloc_kinds" lists "cuda" or "cuda:device"
    (Open MPI >= 6 only when launched with --memory-allocation-kinds system,mpi,cuda:device) or
    if MPIX_Query_cuda_support() returns 1; no if either answers otherwise. Only when the library
    says nothing do the CUDA_ENV_HINTS decide ("1"/"true" yes, "0"/"false" no).
    """
    kinds, query = _memory_alloc_kinds(), _query_cuda_support()
    if {"cuda", "cuda:device"} & set(kinds or ()) or query == 1:  # not cuda:host (pinned) alone
        return True
    if kinds is not None or query is not None:
        return False
    for name in CUDA_ENV_HINTS:
        value = os.environ.get(name, "").strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
    return None


def _setup_cuda(cuda_aware, world: MPI.Comm, import_cupy: Callable[[], ModuleType]) -> Backend:
    node_rank, node_size = local_rank(world)  # collective: before anything that can fail
    try:
        cupy = import_cupy()
    except ModuleNotFoundError as exc:
        if exc.name != "cupy":  # CuPy is there but broken: its own message says why
            raise
        raise DeviceError(CUPY_MISSING) from None
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CUDA raises when there is no driver or no device
        gpus = 0
    if gpus < 1:
        host = socket.gethostname()
        raise DeviceError(f"grid.device = 'cuda' but no CUDA GPU is visible on {host}")
    device_id = node_rank % gpus
    cupy.cuda.Device(device_id).use()
    if node_size > gpus and node_rank == 0:
        log.warning("%d ranks share %d GPUs on %s", node_size, gpus, socket.gethostname())
    if cuda_aware == "auto":
        cuda_aware = bool(detect_cuda_aware())  # unknown -> staging, which always works
    return Backend("cuda", cupy, device_id, cuda_aware, staging=not cuda_aware)


def select_backend(
    device: str,
    cuda_aware: str | bool,
    world: MPI.Comm,
    _import_cupy: Callable[[], ModuleType] | None = None,
) -> Backend:
    """This rank's backend; collective over `world`, called on every rank.

    All ranks reach one verdict: if setup fails anywhere, every rank raises DeviceError with the
    first failing rank's message ("rank N: ..."), so no rank is left waiting in a later call.
    All ranks also agree on cuda_aware: host staging everywhere if any rank's MPI lacks it.
    `_import_cupy` replaces `import cupy` (tests inject a fake).
    """
    import_cupy = _import_cupy or (lambda: importlib.import_module("cupy"))
    backend, error = None, None
    try:
        if device not in DEVICES:
            raise DeviceError(f"grid.device must be one of {', '.join(DEVICES)}; got {device!r}")
        if cuda_aware != "auto" and not isinstance(cuda_aware, bool):
            raise DeviceError(f"grid.cuda_aware must be 'auto', true or false; got {cuda_aware!r}")
        if device == "cpu":
            backend = CPU
        else:
            backend = _setup_cuda(cuda_aware, world, import_cupy)
    except DeviceError as exc:
        error = str(exc)
    except Exception as exc:  # any failure, on any rank, must reach every rank
        error = " ".join(f"grid.device = {device!r}: {type(exc).__name__}: {exc}".split())
    found, aware = agree(world, error, backend is not None and backend.cuda_aware)
    if found:
        raise DeviceError(f"rank {found[0][0]}: {found[0][1]}")
    if backend.name == "cuda" and not all(aware):
        backend.cuda_aware, backend.staging = False, True
    return backend
