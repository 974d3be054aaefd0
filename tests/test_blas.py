"""The OpenBLAS kernel set: chosen before numpy loads (mpihybrid/_blas.py), measured by
`mpihybrid bench blas` (mpihybrid/cli/bench_blas.py). No timing is asserted: the measurement
runs and is saved, and a saved choice reaches a fresh process's OpenBLAS."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mpihybrid._blas import (
    CORE_VAR,
    ENV,
    cache_path,
    candidates,
    choose_blas_core,
    cpu_info,
    machine_key,
    read_choice,
)
from mpihybrid.cli.bench_blas import DEFAULT, best, openblas_core
from tests.helpers import ROOT


def _cache(tmp_path, core, key=None) -> dict:
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    path = cache_path(environ)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"machine": key or machine_key(), "core": core}))
    return environ


def test_choice_follows_the_precedence(tmp_path):
    environ = _cache(tmp_path, "Haswell")
    assert choose_blas_core(dict(environ), modules={}) == "Haswell"
    mine = dict(environ, **{CORE_VAR: "SkylakeX"})  # the user's variable stands
    assert choose_blas_core(mine, modules={}) is None and mine[CORE_VAR] == "SkylakeX"
    off = dict(environ, **{ENV: "off"})
    assert choose_blas_core(off, modules={}) is None and CORE_VAR not in off
    forced = dict(environ, **{ENV: "Sandybridge"})
    assert choose_blas_core(forced, modules={}) == "Sandybridge" == forced[CORE_VAR]
    late = dict(environ)  # numpy loaded already: its BLAS read the variables
    assert choose_blas_core(late, modules={"numpy": None}) is None and CORE_VAR not in late


def test_a_cache_from_another_machine_or_broken_is_ignored(tmp_path):
    other = dict(machine_key(), cpu="another CPU")
    environ = _cache(tmp_path, "Haswell", key=other)
    assert choose_blas_core(dict(environ), modules={}) is None
    path = cache_path(environ)
    path.write_text("{not json")
    assert read_choice(path, machine_key()) is None
    path.write_text(json.dumps({"machine": machine_key(), "core": "NoSuchCore"}))
    assert read_choice(path, machine_key()) is None
    path.write_text(json.dumps({"machine": machine_key(), "core": None}))  # own pick fastest
    assert choose_blas_core({"XDG_CACHE_HOME": str(tmp_path)}, modules={}) is None


def test_candidates_need_their_instructions():
    assert candidates(set()) == []
    assert candidates({"avx", "avx2", "fma"}) == ["Sandybridge", "Haswell"]
    avx512 = {"avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
    assert candidates(avx512) == ["Sandybridge", "Haswell", "SkylakeX"]
    assert "Cooperlake" in candidates(avx512 | {"avx512_bf16"})


def test_the_own_pick_wins_a_tie():
    rows = [{"name": "Haswell", "seconds": 0.995}, {"name": DEFAULT, "seconds": 1.0}]
    assert best(rows) == DEFAULT
    rows[0]["seconds"] = 0.95
    assert best(rows) == "Haswell"
    assert best([{"name": "Haswell", "seconds": 1.0}]) == "Haswell"  # own pick failed to run


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (ENV, CORE_VAR)}
    env.update(XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def test_bench_blas_measures_and_saves(tmp_path):
    if not openblas_core():
        pytest.skip("numpy's BLAS is not OpenBLAS here: bench blas has nothing to choose")
    proc = subprocess.run(
        [sys.executable, "-m", "mpihybrid", "bench", "blas", "--ranks", "1", "--rounds", "1",
         "--repeats", "1", "--json", "--save"],
        capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    names = [r["name"] for r in out["rows"]]
    assert DEFAULT in names and out["fastest"] in names
    assert all(r["gflops"] > 0 and r["kernels"] for r in out["rows"])
    saved = json.loads(cache_path({"XDG_CACHE_HOME": str(tmp_path)}).read_text())
    assert saved["machine"] == machine_key() and out["saved"]
    assert saved["core"] == (None if out["fastest"] == DEFAULT else out["fastest"])


def test_a_saved_choice_reaches_a_fresh_process(tmp_path):
    if not openblas_core():
        pytest.skip("numpy's BLAS is not OpenBLAS here: no kernel set to choose")
    choices = candidates(cpu_info()[1])
    if not choices:
        pytest.skip("no x86-64 vector extension listed in /proc/cpuinfo")
    _cache(tmp_path, choices[0])  # the oldest kernels this CPU runs: never OpenBLAS's own pick
    code = ("import os, mpihybrid; from mpihybrid.cli.bench_blas import openblas_core; "
            f"print(os.environ.get('{CORE_VAR}'), openblas_core())")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(tmp_path), cwd=tmp_path, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [choices[0], choices[0]]
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(_env(tmp_path), **{ENV: "off"}), timeout=60)  # fmt: skip
    assert off.stdout.split()[0] == "None"
    if len(choices) > 1:  # OpenBLAS's own pick is newer than the oldest kernels the CPU runs
        assert off.stdout.split()[1] != choices[0]


def test_bench_blas_bad_job_is_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "mpihybrid", "bench", "blas", str(tmp_path / "nope.toml")],
        capture_output=True, text=True, env=_env(tmp_path), timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [f"mpihybrid: error: job file '{tmp_path / 'nope.toml'}' "
                                       "does not exist"]  # fmt: skip
