"""The pre-run memory check against a real memory cgroup (v1 or v2) that holds an mpiexec run:
a limit 10 % above the check's estimate (plus what the ranks already use when it runs) lets
the job run to its end; one below the estimate is refused in one line, exit 2, before any
step. Once the check passed jobs the kernel then killed (issue #41: exit 9, no word about
memory; a rank peaked at 885 MiB against an estimate of 699 MiB)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from mpihybrid import _numba
from mpihybrid.config import load_job
from mpihybrid.nn import kernels
from mpihybrid.train.memory import load_kernels, rank_estimate
from tests.helpers import ROOT, mpi_command, mpi_env

# the job: the embedded MLP at hidden 3072, depth 6, AdamW, global batch 64 (2 ranks)
JOB = ["model.hidden=3072", "model.depth=6", "train.optimizer=adamw", "train.global_batch=64",
       "train.steps=3"]  # fmt: skip
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _own_memory_cgroup() -> Path | None:
    """This process's memory cgroup directory (v1: the memory controller's; v2: unified)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return Path("/sys/fs/cgroup") / rel.lstrip("/")
    return None


@pytest.fixture
def cgroup():
    """A child of this process's memory cgroup, removed after; skips saying why it cannot."""
    parent = _own_memory_cgroup()
    if parent is None or not parent.is_dir():
        pytest.skip("no memory cgroup to nest in (/proc/self/cgroup names none that is mounted)")
    child = parent / f"mpihybrid-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {exc.strerror} (needs root)")
    v1 = (child / "memory.limit_in_bytes").exists()
    if not v1 and not (child / "memory.max").exists():
        child.rmdir()
        pytest.skip(f"{child} has no memory limit file (memory controller not enabled there)")
    yield child, ("memory.limit_in_bytes" if v1 else "memory.max")
    child.rmdir()  # its processes have ended


def _run_in(cgroup: Path, limit_file: str, limit: int, *args: str):
    import subprocess

    (cgroup / limit_file).write_text(str(limit))
    cmd = mpi_command(2, "-m", "mpihybrid", "train", "--quiet", *args)
    wrapper = f'echo $$ > {cgroup / "cgroup.procs"} && exec "$@"'
    return subprocess.run(["sh", "-c", wrapper, "sh", *cmd], capture_output=True, text=True,
                          env=mpi_env(), cwd=ROOT, timeout=300)  # fmt: skip


def _bytes(text: str) -> int:
    number, unit = text.split()
    return int(float(number) * UNITS[unit])


@pytest.mark.mpi
def test_the_check_holds_under_a_cgroup_limit(cgroup):
    group, limit_file = cgroup
    sets = [a for s in JOB for a in ("--set", s)]
    job = load_job(None, JOB, 2)
    need = sum(sum(rank_estimate(job, p).values()) for p in range(job.grid.pp))
    # what the ranks hold in the cgroup when the check runs (their own pages: the libraries'
    # files are charged where they were first read): a limit of the need itself leaves less
    # than the need, and the refusal's one line says what is in use
    probe = _run_in(group, limit_file, need, *sets)
    assert probe.returncode == 2, probe.stderr
    used = re.search(r", ([\d.]+ [KMG]?i?B) in use\)", probe.stderr)
    assert used, probe.stderr
    in_use = _bytes(used.group(1))
    print(f"estimate {need / 2**20:.1f} MiB, in use at the check {in_use / 2**20:.1f} MiB")
    ran = _run_in(group, limit_file, in_use + int(1.10 * need), *sets)
    print(ran.stdout[-2000:], ran.stderr[-2000:])
    assert ran.returncode == 0, (ran.returncode, ran.stderr[-2000:])  # 9: the kernel killed it
    refused = _run_in(group, limit_file, in_use + int(0.90 * need), *sets)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert lines[0].startswith("mpihybrid: error: the job needs about"), lines[0]
    assert "memory cgroup's limit" in lines[0]


@pytest.mark.skipif(not _numba.ENABLED, reason="numba is not installed: no kernels to load")
def test_the_check_loads_the_kernels_a_step_calls_before_it_measures():
    """What numba's kernels take (40-46 MiB a rank) is in use when the check reads the node and
    cgroup, not added in the first step behind its back."""
    load_kernels(load_job(None, ["train.optimizer=adamw", "model.kind=gpt",
                                 "data.kind=random-tokens"], 2))  # fmt: skip
    assert kernels.adamw_update.signatures and kernels.bias_gelu_forward.signatures
    assert kernels.layernorm_forward.signatures and kernels.softmax_causal_backward.signatures
