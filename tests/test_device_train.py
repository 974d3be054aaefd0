"""Training with arrays on a device: grid.device = "cuda" end to end.

Without a GPU the device is tests/fakegpu, a strict stand-in that computes with numpy but, like
CuPy, refuses any operation that mixes device and host arrays; MPI reaches it through host
staging. So these tests prove that every array of a step lives on the device, that the staging
path carries the pipeline, and that the results are bit for bit those of the CPU running the
numpy references (the device runs them; numba's fused kernels are a host-only fast path, compared
with the references in tests/test_kernels.py). The tests
marked `gpu` repeat the core equivalence test and the seed job on a real GPU with CuPy, and
skip (saying why) where there is none.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mpihybrid import _numba
from mpihybrid.comm.codecs import CODECS
from mpihybrid.config import ConfigError, load_job
from mpihybrid.nn.loss import SoftmaxCrossEntropy
from mpihybrid.nn.model import build_stage
from mpihybrid.nn.optim import build_optimizer
from mpihybrid.train import checkpoint
from mpihybrid.train.state import StageState
from tests import fakegpu
from tests.helpers import results, run_mpi


def test_fake_gpu_refuses_host_arrays_like_cupy():
    d = fakegpu.asarray(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="host array"):
        _ = d + np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="host array"):
        np.matmul(d, np.ones((3, 2), np.float32))
    with pytest.raises(TypeError, match="indexed with a host array"):
        _ = d[np.array([0, 1])]
    with pytest.raises(TypeError, match="without .set"):
        d[...] = np.zeros((2, 3), np.float32)
    host = np.ascontiguousarray(d.T)  # not dispatched: a host copy, which the next op refuses
    with pytest.raises(TypeError, match="host array"):
        _ = host * d.T
    assert type(d * 2.0) is fakegpu.DeviceArray and type(d.sum(axis=0)) is fakegpu.DeviceArray
    assert type(d.get()) is np.ndarray and np.array_equal(d.get(), np.ones((2, 3)))


def _one_step(job, stage, xp_asarray, x, y) -> tuple[float, int]:
    """Forward, loss, split backward and one optimizer step; returns (loss, correct)."""
    loss_fn = SoftmaxCrossEntropy()
    out, cache = stage.forward(xp_asarray(x))
    loss, lcache = loss_fn.forward(out, xp_asarray(y))
    correct = loss_fn.correct(lcache)
    dx, wcache = stage.backward_input(loss_fn.backward(lcache, 0.5), cache, need_dx=False)
    stage.backward_weight(wcache)
    build_optimizer(job.train, stage.flat_params).step(stage.flat_grads)
    return loss, correct


@pytest.mark.parametrize(
    "job_file, overrides",
    [
        ("jobs/gpt_learn.toml", ["grid.pp=1", "model.depth=1", "train.optimizer=adamw"]),
        (None, ["grid.pp=1", "model.norm=true", "model.activation=gelu"]),  # mlp, sgd momentum
    ],
)
def test_a_stage_on_the_device_matches_numpy_bit_for_bit(job_file, overrides, monkeypatch):
    monkeypatch.setattr(_numba, "ENABLED", False)  # the numpy references, as on the device
    job = load_job(job_file, [*overrides, "train.weight_decay=0.01"], 1)
    from mpihybrid.nn.data import task_dims

    in_features, num_classes = task_dims(job.data)
    rng = np.random.default_rng(0)
    if job.model.kind == "gpt":
        x = rng.integers(0, num_classes, (3, in_features))
        y = rng.integers(0, num_classes, (3, in_features))
    else:
        x = rng.standard_normal((5, in_features)).astype(np.float32)
        y = rng.integers(0, num_classes, 5)
    host = build_stage(job.model, in_features, num_classes, 0, 1, seed=0)
    device = build_stage(job.model, in_features, num_classes, 0, 1, seed=0)
    device.to_device(fakegpu.asarray)
    assert type(device.layers[-1].params["weight"]) is fakegpu.DeviceArray
    expected = _one_step(job, host, lambda a: a, x, y)
    got = _one_step(job, device, fakegpu.asarray, x, y)
    assert got == expected
    assert type(device.flat_params) is fakegpu.DeviceArray
    np.testing.assert_array_equal(device.flat_grads.get(), host.flat_grads)
    np.testing.assert_array_equal(device.flat_params.get(), host.flat_params)


def test_checkpoint_of_device_arrays_round_trips(tmp_path):
    job = load_job("jobs/gpt_learn.toml", ["grid.pp=1", "model.depth=1"], 1)
    from mpihybrid.nn.data import task_dims

    dims = task_dims(job.data)
    saved = build_stage(job.model, *dims, 0, 1, seed=0)
    saved.to_device(fakegpu.asarray)
    opt = build_optimizer(job.train, saved.flat_params)
    saved.flat_grads += 0.5
    opt.step(saved.flat_grads)
    ring = SimpleNamespace(residual=None, bind=lambda optimizer: None)
    checkpoint.save_rank(tmp_path, StageState(0, saved, opt, ring), 0, step=1)
    loaded = build_stage(job.model, *dims, 0, 1, seed=7)  # other weights, overwritten on load
    loaded.to_device(fakegpu.asarray)
    opt2 = build_optimizer(job.train, loaded.flat_params)
    checkpoint.load_rank(tmp_path, StageState(0, loaded, opt2, ring), dp_rank=0, same_dp=True)
    assert type(loaded.flat_params) is fakegpu.DeviceArray  # still on the device, loaded in place
    np.testing.assert_array_equal(loaded.flat_params.get(), saved.flat_params.get())
    for name, buf in opt.state().items():
        np.testing.assert_array_equal(opt2.state()[name].get(), buf.get())


def test_device_settings_are_checked():
    with pytest.raises(ConfigError, match="grid.device = 'tpu': unknown; choose one of cpu, cuda"):
        load_job(None, ["grid.device=tpu"], 2)
    with pytest.raises(ConfigError, match="comm.cuda_aware = 'maybe'"):
        load_job(None, ["comm.cuda_aware=maybe"], 2)
    for value, expected in (("true", True), ("false", False), ("auto", "auto")):
        assert load_job(None, [f"comm.cuda_aware={value}"], 2).comm.cuda_aware == expected


@pytest.mark.mpi
@pytest.mark.parametrize(
    "ranks, job, overrides, schedules",
    [
        (4, "jobs/gpt_learn.toml", ["grid.dp=2"], "1f1b,zb-h1"),
        (
            4,
            None,
            [
                "grid.pp=2",
                "grid.dp=2",
                "train.microbatches=4",
                "train.global_batch=64",
                "comm.codec=int8",
            ],
            "interleaved-1f1b",
        ),  # fmt: skip
    ],
)
def test_staged_device_training_equals_the_cpu_bit_for_bit(ranks, job, overrides, schedules):
    """The whole pipeline with device arrays and MPI through host staging: the same losses and
    parameters as the CPU run, and every activation crossed the wire through a host copy."""
    argv = [*(["--job", job] if job else []), "--schedules", schedules, "--serial"]
    argv += [a for o in [*overrides, "train.steps=3"] for a in ("--set", o)]
    env = {"MPIHYBRID_KERNELS": "numpy"}  # the numpy references, as on the device
    cpu = results(run_mpi(ranks, "tests/_mpi_train.py", *argv, timeout=120, env=env))
    gpu = results(run_mpi(ranks, "tests/_mpi_train.py", "--fake-gpu", *argv, timeout=120, env=env))
    assert len(cpu) == len(gpu) == len(schedules.split(","))
    for c, g in zip(cpu, gpu, strict=True):
        assert g["device"] == "cuda:0 (host staging)" and c["device"] == "cpu"
        assert g["losses"] == c["losses"] and g["test_accuracy"] == c["test_accuracy"]
        assert g["max_abs_diff"] == c["max_abs_diff"]  # the same distance from serial as the cpu
        assert g["replica_max_diff"] == 0.0 and g["bytes_sent"] == c["bytes_sent"]
        # rank 0 (stage 0) copied its sends out and its receives in, every micro-batch
        assert g["copies"]["to_host"] >= 3 * 4 and g["copies"]["to_device"] >= 3 * 4


def cuda_gpus() -> str | None:
    """Why the real-GPU tests cannot run here, or None when they can."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy not installed (pip install 'mpihybrid[cuda]')"
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        return f"no CUDA GPU: {type(exc).__name__}: {exc}"
    return None if count > 0 else "no CUDA GPU"


@pytest.fixture
def real_gpu() -> None:
    """Skips the test, saying why, unless CuPy and a CUDA GPU are here."""
    reason = cuda_gpus()
    if reason:
        pytest.skip(reason)


@pytest.mark.mpi
def test_cuda_without_a_gpu_or_cupy_is_one_clear_error():
    if cuda_gpus() is None:
        pytest.skip("this machine has a GPU and CuPy: grid.device = 'cuda' trains here")
    proc = run_mpi(2, "-m", "mpihybrid", "train", "--set", "grid.device=cuda", timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr
    assert "rank 0: grid.device = 'cuda'" in errors[0]
    assert "needs CuPy" in errors[0] or "no CUDA GPU" in errors[0]


@pytest.mark.mpi
@pytest.mark.gpu
def test_cuda_hybrid_equals_serial_on_a_real_gpu(real_gpu):
    argv = ["--serial", "--schedules", "1f1b,zb-h1"]
    for o in ("grid.device=cuda", "grid.pp=2", "grid.dp=2", "train.steps=5", "model.depth=8",
              "model.hidden=32", "train.microbatches=4", "train.global_batch=32"):  # fmt: skip
        argv += ["--set", o]
    for run in results(run_mpi(4, "tests/_mpi_train.py", *argv, timeout=300)):
        print(f"{run['schedule']} on {run['device']}: max |hybrid - serial| "
              f"{run['max_abs_diff']:.2e}")  # fmt: skip
        assert run["device"].startswith("cuda:")
        assert run["max_abs_diff"] < 1e-4  # cuBLAS sums in another order than numpy
        np.testing.assert_allclose(run["losses"], run["serial_losses"], rtol=1e-4)
        assert run["replica_max_diff"] == 0.0


@pytest.mark.mpi
@pytest.mark.gpu
def test_cuda_seed_job_on_a_real_gpu(real_gpu):
    job = str(Path("jobs/seed_k3_d4.toml"))
    proc = run_mpi(12, "tests/_mpi_train.py", "--job", job, "--set", "grid.device=cuda",
                   timeout=600)  # fmt: skip
    (run,) = results(proc)
    print(f"seed job on {run['device']}: held-out accuracy {run['test_accuracy']:.4f}, "
          f"final loss {run['losses'][-1]:.5f}")  # fmt: skip
    assert run["device"].startswith("cuda:")
    assert run["test_accuracy"] >= 0.95 and run["replica_max_diff"] == 0.0


@pytest.mark.mpi
def test_ring_on_the_device_sends_only_encoded_bytes():
    """The gradient ring on device arrays (host staging): the same bits as on the host, the
    residual kept on the device, and to the host only what goes on the wire."""
    runs = results(run_mpi(2, "tests/_mpi_device_ring.py", timeout=120))
    assert [r["codec"] for r in runs] == list(CODECS)
    for run in runs:
        for rank in run["ranks"]:
            label = f"{run['codec']}: {rank}"
            assert rank["same_bits"] and rank["residual_on_device"], label
            assert rank["staging_dropped"], label
            # the ring's own messages (the result is left on the device), plus the vector's
            # copy the test itself takes (`.get()` comes after the count)
            assert rank["to_host_bytes"] == rank["sent_bytes"], label
            if run["codec"] == "int8":
                assert rank["sent_bytes"] < 0.27 * rank["vector_bytes"], label
