"""Which of OpenBLAS's kernel sets numpy's matmuls run: the one measured fastest on this machine.

OpenBLAS ships kernels for many CPU families and picks one by the CPU it finds. Its pick is not
always the fastest: on the AMD EPYC (Zen 4, AVX-512) this project is measured on, it picks the
SkylakeX (AVX-512) kernels, and its Haswell (AVX2) kernels run the GPT benchmark's matmuls about
10 % faster (docs/performance.md). `mpihybrid bench blas --save` times the model's own GEMMs
under every kernel set the CPU can run and writes the fastest to a per-machine cache; every
mpihybrid process then sets OPENBLAS_CORETYPE from it before numpy loads its BLAS (the library
reads the variable once, when it loads), as `_threads` sets the thread count:

    OPENBLAS_CORETYPE set by the user   -> it stands
    MPIHYBRID_BLAS=off                  -> OpenBLAS's own pick (the tests run so)
    MPIHYBRID_BLAS=NAME                 -> NAME
    a cache written on this CPU         -> its choice
    otherwise                           -> OpenBLAS's own pick

The cache is $XDG_CACHE_HOME/mpihybrid/blas.json (~/.cache/...); it names the CPU model and the
OpenBLAS build it was measured with, and is ignored on any other. Standard library only: this
runs before numpy is imported.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
from pathlib import Path

ENV = "MPIHYBRID_BLAS"
CORE_VAR = "OPENBLAS_CORETYPE"
# OpenBLAS kernel sets this chooses between, each with the CPU flags its kernels need
# (OpenBLAS's dynamic dispatch for x86-64; Zen and the newer Intel names reuse these kernels)
CORES = {
    "Sandybridge": ("avx",),
    "Haswell": ("avx2", "fma"),
    "SkylakeX": ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"),
    "Cooperlake": ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"),
}


def cache_path(environ=os.environ) -> Path:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpihybrid" / "blas.json"


def cpu_info() -> tuple[str, set[str]]:
    """(model name, flags) of this machine's first CPU; ("", set()) where /proc is not there."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
        if model and flags:
            break
    return model, flags


def openblas_path() -> str:
    """Path of the OpenBLAS that numpy bundles ("" if none is found), without importing numpy."""
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.origin:
        return ""
    here = os.path.dirname(spec.origin)
    found = sorted(glob.glob(os.path.join(here, os.pardir, "numpy.libs", "*openblas*")))
    found += sorted(glob.glob(os.path.join(here, ".dylibs", "*openblas*")))
    return found[0] if found else ""


def openblas_file() -> str:
    """File name of numpy's OpenBLAS ("" if none is found): it names the build."""
    return os.path.basename(openblas_path())


def machine_key() -> dict[str, str]:
    """What a choice was measured on: a cache from another CPU or OpenBLAS is not used."""
    model, flags = cpu_info()
    return {
        "cpu": model,
        "flags": " ".join(sorted(f for need in CORES.values() for f in need if f in flags)),
        "openblas": openblas_file(),
    }


def candidates(flags: set[str]) -> list[str]:
    """The kernel sets whose instructions this CPU has."""
    return [name for name, need in CORES.items() if all(f in flags for f in need)]


def read_choice(path: Path, key: dict[str, str]) -> str | None:
    """The cached core name when the cache was written for `key`, else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("machine") != key:
        return None
    core = data.get("core")
    return core if core in CORES else None


def choose_blas_core(environ=os.environ, modules=sys.modules) -> str | None:
    """Set OPENBLAS_CORETYPE as the table in the module's docstring says; return what was set."""
    if "numpy" in modules or environ.get(CORE_VAR):
        return None  # too late to matter, or the user's choice
    wanted = environ.get(ENV, "")
    if wanted.lower() == "off":
        return None
    if wanted:
        environ[CORE_VAR] = wanted
        return wanted
    path = cache_path(environ)
    if not path.is_file():
        return None
    core = read_choice(path, machine_key())
    if core is not None:
        environ[CORE_VAR] = core
    return core
