"""model.vocab_parallel's files: a checkpoint holds each share as a chunk and resumes bit for bit;
resuming it without vocab_parallel is refused in one line; `weights export` gathers the whole
nanoGPT-named tensors (== the serial model's); model.init splits a whole file on
load (the same first loss as the unsplit model started from it)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

# weights export and model.init read and write safetensors files: the `weights` extra
pytest.importorskip("safetensors", reason="safetensors is not installed (the weights extra)")
from safetensors.numpy import load_file  # noqa: E402

from mpihybrid.config import load_job  # noqa: E402
from mpihybrid.nn.model import build_stage  # noqa: E402
from mpihybrid.nn.weights import export_tensors  # noqa: E402
from mpihybrid.trace.read import load  # noqa: E402
from mpihybrid.train.tie import bind_local  # noqa: E402
from tests.helpers import mpi_env, run_mpi  # noqa: E402
from tests.serial_reference import train_serial  # noqa: E402

TINY = ["model.kind=gpt", "model.hidden=16", "model.heads=2", "model.ffn=32", "model.depth=2",
        "data.vocab=37", "data.seq_len=8", "data.test_samples=4", "data.kind=markov",
        "comm.codec=fp32", "train.optimizer=adamw", "train.lr=3e-3", "train.microbatches=2",
        "train.global_batch=4", "grid.pp=2", "train.steps=4"]  # fmt: skip
VP = "model.vocab_parallel=true"


def _train(tmp_path, name, *settings, ranks=2, extra=()):
    args = ["-m", "mpihybrid", "train", "--quiet", "--trace", str(tmp_path / f"{name}.h5"),
            *[a for s in [*TINY, *settings] for a in ("--set", s)], *extra]  # fmt: skip
    return run_mpi(ranks, *args, timeout=180)


def _export(ckpt, out):
    cmd = [sys.executable, "-m", "mpihybrid", "weights", "export", str(ckpt), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return load_file(str(out))


@pytest.mark.mpi
@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_resume_export_and_init(tmp_path, tied):
    tie = [f"model.tie_embeddings={str(tied).lower()}"]
    vp = tmp_path / "vp"
    every = ["checkpoint.every=2", "checkpoint.keep=3"]
    proc = _train(tmp_path, "whole", VP, *tie, *every, f"checkpoint.dir={vp}")
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(vp / "step-000004")
    proc = _train(tmp_path, "resumed", VP, *tie, *every, f"checkpoint.dir={vp}", extra=["--resume"])
    assert proc.returncode == 0, proc.stderr
    whole, resumed = (load(tmp_path / f"{k}.h5").steps["loss"] for k in ("whole", "resumed"))
    np.testing.assert_array_equal(resumed, whole)  # bit for bit
    if not tied:  # the other layout: one line, exit 2
        shutil.rmtree(vp / "step-000004")
        proc = _train(tmp_path, "off", *every, f"checkpoint.dir={vp}", extra=["--resume"])
        assert proc.returncode == 2
        assert "written with model.vocab_parallel = true, this job has false" in proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    # weights export: the whole tensors, as the serial model after the same 2 steps holds them
    got = _export(vp / "step-000002", tmp_path / "vp.safetensors")
    job = load_job(None, [*TINY, *tie, "grid.pp=1", "train.steps=2"], 1)
    flat, _ = train_serial(job)
    serial = build_stage(job.model, 8, 37, 0, 1, seed=0)
    serial.flat_params[...] = flat
    bind_local([serial], job.model)
    want = export_tensors([serial], job.model.depth + 2)
    assert sorted(got) == sorted(want)
    for name in want:
        # AdamW: a near-zero gradient's float-order difference moves its step by ~1e-6
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # model.init: the whole file split on load, against the unsplit model from the same file
    init = f"model.init={tmp_path / 'vp.safetensors'}"
    one = ["train.steps=1"]
    proc = _train(tmp_path, "init_vp", VP, *tie, init, *one)
    assert proc.returncode == 0, proc.stderr
    proc = _train(tmp_path, "init_plain", *tie, init, *one)
    assert proc.returncode == 0, proc.stderr
    a, b = (load(tmp_path / f"{k}.h5").steps["loss"] for k in ("init_vp", "init_plain"))
    np.testing.assert_allclose(a, b, rtol=1e-6)
