"""slurm/ batch scripts on a real one-node SLURM cluster (tests/slurm_cluster.py), and the A100 job.

Each submission runs the laptop job, shrunk, as 4 ranks on the local node, with the command line a
user with no GPUs would type: `--nodes=1 --ntasks-per-node=4 --cpus-per-task=1 --gpus-per-node=0`.
The cluster tests skip, saying why, where slurm-wlm is not installed or we are not root.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpihybrid.config import load_job
from mpihybrid.trace.read import load
from tests.helpers import ROOT, run_mpi
from tests.slurm_cluster import slurm_cluster, unavailable_reason

pytestmark = pytest.mark.slurm

SCRIPTS = sorted((ROOT / "slurm").glob("*.sbatch")) + sorted((ROOT / "slurm").glob("*.sh"))
LAPTOP = str(ROOT / "jobs" / "laptop.toml")
# The laptop job, small: ~20 ms a step on 2 oversubscribed cores.
SMALL = "model.hidden=16 train.global_batch=32 data.train_samples=1024 data.test_samples=64"
LOCAL_NODE = ["--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1", "--gpus-per-node=0"]


def test_every_script_parses():
    assert any(p.name == "train.sbatch" for p in SCRIPTS)
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr}"


def test_a100_jobs_validate_for_16_ranks():
    job = load_job(ROOT / "jobs" / "a100_mlp.toml", [], 16)
    assert (job.grid.pp, job.grid.dp) == (4, 4)
    assert job.model.depth >= 8 * job.grid.pp and job.model.hidden >= 4096


def test_a100_gpt_job_fits_an_a100_per_rank():
    """The sizes its comment states: 780 M parameters, at most 221 M on one stage (3.5 GB of
    parameters, gradient and AdamW moments), on the GPU."""
    from mpihybrid.nn.model import stage_num_params

    job = load_job(ROOT / "jobs" / "a100_gpt.toml", [], 16)
    assert (job.grid.pp, job.grid.dp, job.grid.device) == (4, 4, "cuda")
    per_stage = stage_num_params(job.model, job.data.seq_len, job.data.vocab, job.grid.pp)
    assert round(sum(per_stage) / 1e6) == 780
    assert [round(n / 1e6) for n in per_stage] == [221, 170, 198, 191]
    assert max(per_stage) * 16 < 4e9


def sweep_entries(path: Path) -> list[list[str]]:
    lines = [line.split() for line in path.read_text().splitlines()]
    return [words for words in lines if words and not words[0].startswith("#")]


def test_sweep_list_lines_validate_for_16_ranks():
    entries = sweep_entries(ROOT / "slurm" / "sweep.list")
    array = re.search(r"^#SBATCH --array=0-(\d+)", (ROOT / "slurm/sweep.sbatch").read_text(), re.M)
    assert array and int(array.group(1)) == len(entries) - 1, "--array does not match the list"
    for job_file, *rest in entries:
        assert rest[::2] == ["--set"] * (len(rest) // 2) and len(rest) % 2 == 0, rest
        load_job(ROOT / job_file, rest[1::2], 16)


@pytest.mark.parametrize("script", ["train.sbatch", "sweep.sbatch"])
def test_running_a_script_without_sbatch_says_so(script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / script)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 2
    assert "not inside a SLURM job" in proc.stderr and "sbatch slurm/" in proc.stderr
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def job_env(**extra: str) -> dict[str, str]:
    """What a user sets before `sbatch`: the interpreter, the launcher the local SLURM has."""
    env = {
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "SRUN_MPI": "pmi2",  # Debian's SLURM has no PMIx library; pmi2 speaks to the mpich wheel
        "JOB": LAPTOP,
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


def submit(cluster, cwd: Path, script: str, *train_args: str, env: dict, array: str = "") -> str:
    """sbatch SCRIPT from `cwd` for the local node; `train_args` follow the script."""
    (cwd / "runs").mkdir(exist_ok=True)
    options = [*LOCAL_NODE, "--time=5", *([f"--array={array}"] if array else [])]
    return cluster.sbatch(ROOT / "slurm" / script, *options, args=train_args, env=env, cwd=cwd)


@pytest.mark.parametrize(
    "launch, command",
    [("srun", "srun --mpi=pmi2 --cpus-per-task=1 "), ("mpiexec", "mpiexec -n 4 ")],
    ids=["srun", "mpiexec"],
)
def test_train_sbatch_trains_and_writes_its_trace(cluster, tmp_path, launch, command):
    # As if submitted from the activated virtualenv: its mpiexec (the mpich wheel's) on PATH.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    job_id = submit(
        cluster,
        tmp_path,
        "train.sbatch",
        "--set",
        "train.steps=6",  # arguments after the script reach `mpihybrid train`
        "--quiet",
        env=job_env(SET=f"{SMALL} comm.codec=int8", MPI_LAUNCH=launch, PATH=path),
    )
    job = cluster.wait(job_id, timeout=90)
    out = (tmp_path / "runs" / f"mpihybrid-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), out + cluster.logs()
    assert "SLURM_RESTART_COUNT=0" in out and f"{command}{sys.executable} -m mpihybrid" in out
    trace = load(tmp_path / "runs" / f"mpihybrid-{job_id}" / "trace.h5")
    assert len(trace.steps["loss"]) == 6
    assert (trace.attrs["world_size"], trace.attrs["codec"]) == (4, "int8")
    assert np.all(np.isfinite(trace.steps["loss"]))


def test_sweep_sbatch_runs_each_line_in_its_own_dir(cluster, tmp_path):
    overrides = " ".join(f"--set {kv}" for kv in SMALL.split())
    listing = tmp_path / "two.list"
    listing.write_text(
        f"# two short runs\n{LAPTOP} --set train.steps=3 --set comm.codec=fp16 {overrides}\n\n"
        f"{LAPTOP} --set train.steps=4 {overrides}\n"
    )
    env = job_env(LIST=str(listing), TRAIN_SBATCH=str(ROOT / "slurm" / "train.sbatch"))
    array_id = submit(cluster, tmp_path, "sweep.sbatch", "--quiet", env=env, array="0-1")
    for index, (steps, codec) in enumerate([(3, "fp16"), (4, "fp32")]):
        job = cluster.wait(f"{array_id}_{index}", timeout=90)
        out = (tmp_path / "runs" / f"mpihybrid-sweep-{array_id}_{index}.out").read_text()
        assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), out
        trace = load(tmp_path / "runs" / f"mpihybrid-sweep-{array_id}" / str(index) / "trace.h5")
        assert (len(trace.steps["loss"]), trace.attrs["codec"]) == (steps, codec)


def preempt_when_checkpointed(cluster, job_id: str, ckpt: Path) -> None:
    """Wait for the first complete checkpoint, then send USR1 to the batch shell only."""
    cluster.wait(job_id, timeout=60, until=lambda job: any(ckpt.glob("step-*")))
    cluster.command("scancel", "--signal=USR1", "--batch", job_id)


def test_preempted_job_requeues_and_resumes_to_the_same_loss(cluster, tmp_path):
    steps = 200
    settings = f"{SMALL} train.steps={steps}"
    run_dir = tmp_path / "run"
    env = job_env(SET=f"{settings} checkpoint.every=1", RUN_DIR=str(run_dir))
    job_id = submit(cluster, tmp_path, "train.sbatch", "--quiet", env=env)
    preempt_when_checkpointed(cluster, job_id, run_dir / "ckpt")
    job = cluster.wait(job_id, timeout=120)
    out = (tmp_path / "runs" / f"mpihybrid-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    assert "SLURM_RESTART_COUNT=1" in out and "requeueing (restart 1 of at most 3)" in out
    stopped_at = int(re.search(r"preempted at step (\d+): checkpoint written", out).group(1))
    assert 0 < stopped_at < steps, "the signal must land mid-run for this test to mean anything"

    reference = tmp_path / "reference.h5"
    argv = ["-m", "mpihybrid", "train", LAPTOP, "--quiet", "--trace", str(reference)]
    proc = run_mpi(4, *argv, *[a for kv in settings.split() for a in ("--set", kv)])
    assert proc.returncode == 0, proc.stderr
    resumed = load(run_dir / "trace.h5").steps["loss"]
    expected = load(reference).steps["loss"]
    print(f"stopped at step {stopped_at}; final loss {resumed[-1]:.17g} vs {expected[-1]:.17g}")
    # The checkpoint carries the losses so far: the resumed trace holds every step's loss.
    assert len(resumed) == len(expected) == steps
    np.testing.assert_array_equal(resumed, expected)


def test_preempted_past_max_restarts_is_not_requeued(cluster, tmp_path):
    run_dir = tmp_path / "run"
    env = job_env(SET=f"{SMALL} train.steps=400", RUN_DIR=str(run_dir), MAX_RESTARTS="0")
    job_id = submit(cluster, tmp_path, "train.sbatch", "--set", "checkpoint.every=1", env=env)
    preempt_when_checkpointed(cluster, job_id, run_dir / "ckpt")
    job = cluster.wait(job_id, timeout=60)
    out = (tmp_path / "runs" / f"mpihybrid-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "3:0", "0"), out
    assert "not requeued" in out
    # the trace written as the run went stays, saying where the run stopped
    trace = load(run_dir / "trace.h5")
    assert not trace.attrs["finished"] and trace.attrs["stopped_at_step"] > 0, trace.attrs
