"""A strict stand-in for CuPy on the CPU: "device" arrays that refuse to mix with host arrays.

    backend = select_backend("cuda", False, world, _import_cupy=lambda: tests.fakegpu)

`DeviceArray` is a numpy array underneath, so the arithmetic is numpy's, bit for bit. What it
adds is CuPy's rule: an operation that mixes a device array with a host `np.ndarray` (a forgotten
`np.empty`, a mask or index left on the host) raises TypeError, as CuPy does, and
numpy's array-creation functions (`np.asarray`, `np.ascontiguousarray`, which NEP 18 does not
dispatch) hand back a plain host array, so the next operation that mixes it with device arrays
raises: a call that would fail on CuPy fails here too.
Copies between the two go through `.get()` / `.set()` / `asarray`, as with CuPy. The module
itself is the array module (`xp`): `empty`, `zeros`, `arange`, ... make device arrays, and
`cuda` has just enough of CuPy's CUDA namespace for mpihybrid.comm.device. `counts` tallies the
host <-> device copies, so a test can see the staging path was taken.
"""

from __future__ import annotations

import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np

counts: Counter = Counter()


def _is_host(a) -> bool:
    return isinstance(a, np.ndarray) and not isinstance(a, DeviceArray) and a.ndim > 0


def _unwrap(items):
    for a in items:
        if _is_host(a):
            raise TypeError(f"host array {a.dtype}{list(a.shape)} mixed with device arrays")
        if isinstance(a, (list, tuple)):
            yield type(a)(_unwrap(a))
        else:
            yield a.view(np.ndarray) if isinstance(a, DeviceArray) else a


def _wrap(result):
    if isinstance(result, np.ndarray) and not isinstance(result, DeviceArray):
        return result.view(DeviceArray)
    if isinstance(result, tuple):
        return tuple(_wrap(r) for r in result)
    return result


class DeviceArray(np.ndarray):
    """An array "on the GPU": numpy storage, CuPy's rules about the host."""

    __module__ = __name__  # what mpihybrid.comm.device.array_module looks up

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            kwargs["out"] = tuple(_unwrap(kwargs["out"]))
        result = getattr(ufunc, method)(*_unwrap(inputs), **kwargs)
        return None if method == "at" else _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        if "out" in kwargs and kwargs["out"] is not None:
            kwargs["out"] = next(_unwrap([kwargs["out"]]))
        return _wrap(func(*_unwrap(args), **kwargs))

    def __array__(self, dtype=None, copy=None):
        raise TypeError("implicit conversion of a device array to numpy: use .get()")

    def __getitem__(self, index):
        items = index if isinstance(index, tuple) else (index,)
        if any(_is_host(i) for i in items):
            raise TypeError("a device array indexed with a host array")
        return super().__getitem__(index)

    def __setitem__(self, index, value):
        items = index if isinstance(index, tuple) else (index,)
        if any(_is_host(i) for i in items) or _is_host(value):
            raise TypeError("host array written into a device array without .set()")
        super().__setitem__(index, value)

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        counts["to_host"] += 1
        counts["to_host_bytes"] += self.nbytes
        host = self.view(np.ndarray)
        if out is None:
            return host.copy()
        np.copyto(out, host)
        return out

    def set(self, host: np.ndarray) -> None:
        counts["to_device"] += 1
        counts["to_device_bytes"] += self.nbytes
        if not _is_host(host) or host.shape != self.shape:
            raise TypeError(f"set() takes a host array of shape {self.shape}")
        np.copyto(self.view(np.ndarray), host)


def asarray(a, dtype=None) -> DeviceArray:
    if isinstance(a, DeviceArray):
        return a if dtype is None else a.astype(dtype)
    counts["to_device"] += 1
    return np.array(a, dtype=dtype, copy=True).view(DeviceArray)


def _creator(name: str):
    make = getattr(np, name)

    def create(*args, **kwargs):
        return make(*_unwrap(args), **kwargs).view(DeviceArray)

    create.__name__ = name
    return create


_CREATORS = ("empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like")
for _name in (*_CREATORS, "ascontiguousarray"):
    setattr(sys.modules[__name__], _name, _creator(_name))


def __getattr__(name: str):
    """Everything else is numpy's: ufuncs and functions that dispatch on their arguments."""
    return getattr(np, name)


class _Stream:
    def synchronize(self) -> None:
        counts["synchronize"] += 1


_stream = _Stream()
cuda = SimpleNamespace(
    runtime=SimpleNamespace(getDeviceCount=lambda: 1),
    Device=lambda i: SimpleNamespace(use=lambda: None),
    get_current_stream=lambda: _stream,
)
