"""Device backends: numpy in-process, staging logic against a fake CuPy, selection under mpiexec.

The "cuda" selection cases run with a fake CuPy (tests/_mpi_device.py), so they need no GPU; the
one test that needs real CuPy and a GPU skips without them.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest

from mpihybrid.comm import device
from mpihybrid.comm.device import CUPY_MISSING, Backend
from tests.helpers import results, run_mpi


def cpu_backend(staging: bool = False) -> Backend:
    return Backend("cpu", np, None, cuda_aware=False, staging=staging)


def test_cpu_arrays_round_trip_without_copies():
    b = cpu_backend()
    assert b.empty((2, 3), np.float32).shape == (2, 3)
    zeros = b.zeros((4,), np.float32)
    assert zeros.dtype == np.float32 and not zeros.any()
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = b.asarray(host)
    assert x is host and b.to_host(x) is host
    out = np.empty_like(host)
    assert b.to_host(x, out=out) is out and np.array_equal(out, host)
    b.synchronize()
    assert not b.staging and b.describe() == "cpu"


def test_cpu_mpi_buffers_are_the_arrays():
    b = cpu_backend()
    x = np.ones(5, np.float32)
    assert b.mpi_send_buffer(x, "a") is x
    assert b.mpi_recv_buffer(x, "a") is x
    b.finish_recv(x, "a")
    assert np.array_equal(x, np.ones(5))


def test_forced_staging_send_buffer_is_a_persistent_host_copy():
    b = cpu_backend(staging=True)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    send = b.mpi_send_buffer(x, ("F", 1, 0))
    assert send is not x and not np.shares_memory(send, x)
    assert np.array_equal(send, x)
    x += 100  # the next call refreshes the same buffer with the new contents
    again = b.mpi_send_buffer(x, ("F", 1, 0))
    assert again is send and np.array_equal(again, x)
    assert b.mpi_send_buffer(x, ("F", 1, 1)) is not send  # another key, another buffer
    assert b.describe() == "cpu (host staging)"


def test_forced_staging_recv_lands_in_host_buffer_then_array():
    b = cpu_backend(staging=True)
    x = np.zeros((2, 5), np.float32)
    recv = b.mpi_recv_buffer(x, "in")
    assert recv is not x and b.mpi_recv_buffer(x, "in") is recv
    assert b.mpi_send_buffer(x, "in") is not recv  # sends and receives never share a buffer
    recv[...] = np.arange(10).reshape(2, 5)  # what MPI would write
    assert not x.any()
    b.finish_recv(x, "in")
    assert np.array_equal(x, np.arange(10).reshape(2, 5))


def test_staging_buffer_rejects_another_shape_for_the_same_key():
    b = cpu_backend(staging=True)
    b.mpi_send_buffer(np.zeros((2, 3), np.float32), "k")
    with pytest.raises(ValueError, match=r"send staging buffer 'k'.*float32\[3, 2\]"):
        b.mpi_send_buffer(np.zeros((3, 2), np.float32), "k")


class FakeDeviceArray(np.ndarray):
    """A numpy array that copies to and from the host the way a CuPy array does."""

    log: list[str] = []

    def get(self, out=None):
        FakeDeviceArray.log.append("get")
        if out is None:
            return np.array(self, copy=True).view(np.ndarray)
        np.copyto(out, self.view(np.ndarray))
        return out

    def set(self, host):
        FakeDeviceArray.log.append("set")
        np.copyto(self.view(np.ndarray), host)


def fake_cuda_backend(cuda_aware: bool) -> Backend:
    stream = SimpleNamespace(synchronize=lambda: FakeDeviceArray.log.append("sync"))
    xp = SimpleNamespace(
        asarray=lambda a: np.array(a).view(FakeDeviceArray),
        zeros=lambda shape, dtype: np.zeros(shape, dtype).view(FakeDeviceArray),
        cuda=SimpleNamespace(get_current_stream=lambda: stream),
    )
    FakeDeviceArray.log = []
    return Backend("cuda", xp, 1, cuda_aware=cuda_aware, staging=not cuda_aware)


def test_cuda_staging_synchronizes_before_copying_out_and_copies_back_in():
    b = fake_cuda_backend(cuda_aware=False)
    assert b.describe() == "cuda:1 (host staging)"
    x = b.asarray(np.arange(4, dtype=np.float32))
    send = b.mpi_send_buffer(x, "out")
    assert type(send) is np.ndarray and np.array_equal(send, [0, 1, 2, 3])
    assert FakeDeviceArray.log == ["sync", "get"]  # the stream is drained before the copy
    y = b.zeros((4,), np.float32)
    recv = b.mpi_recv_buffer(y, "in")
    assert type(recv) is np.ndarray
    recv[...] = [5, 6, 7, 8]
    b.finish_recv(y, "in")
    assert FakeDeviceArray.log[-1] == "set" and np.array_equal(b.to_host(y), [5, 6, 7, 8])


def test_cuda_aware_hands_device_arrays_to_mpi_after_synchronizing():
    b = fake_cuda_backend(cuda_aware=True)
    assert b.describe() == "cuda:1 (CUDA-aware MPI)"
    x = b.zeros((3,), np.float32)
    assert b.mpi_send_buffer(x, "out") is x and b.mpi_recv_buffer(x, "in") is x
    assert FakeDeviceArray.log == ["sync", "sync"]


def test_cuda_without_cuda_aware_mpi_must_stage():
    with pytest.raises(ValueError, match="staging"):
        Backend("cuda", np, 0, cuda_aware=False, staging=False)


@pytest.mark.parametrize(
    "kinds, query, env, expected",
    [
        (["mpi", "system", "cuda:device"], None, {}, True),  # MPI 4.1 info says yes
        (None, 1, {}, True),  # MPIX_Query_cuda_support says yes
        (["mpi", "system"], 1, {}, True),  # Open MPI 6 without --memory-allocation-kinds
        (["mpi", "system", "cuda:host"], None, {}, False),  # pinned host memory is not enough
        (["mpi", "system"], None, {"MV2_USE_CUDA": "1"}, False),  # the library's no beats hints
        (None, 0, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, False),
        (None, None, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, True),  # silent library: hints decide
        (None, None, {"OMPI_MCA_opal_cuda_support": "false"}, False),
        (None, None, {}, None),
    ],
)
def test_detect_cuda_aware_trusts_the_library_before_hints(
    monkeypatch, kinds, query, env, expected
):
    monkeypatch.setattr(device, "_memory_alloc_kinds", lambda: kinds)
    monkeypatch.setattr(device, "_query_cuda_support", lambda: query)
    for name in device.CUDA_ENV_HINTS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert device.detect_cuda_aware() is expected


@pytest.mark.gpu
def test_cupy_gpu_round_trip():
    cupy = pytest.importorskip("cupy", reason="CuPy not installed")
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        gpus = 0
    if gpus < 1:
        pytest.skip("no CUDA GPU visible")
    cupy.cuda.Device(0).use()
    b = Backend("cuda", cupy, 0, cuda_aware=False, staging=True)
    host = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
    x = b.asarray(host)
    assert isinstance(x, cupy.ndarray)
    assert np.array_equal(b.to_host(x), host)
    assert np.array_equal(b.mpi_send_buffer(x * 2, "out"), host * 2)
    y = b.zeros(host.shape, np.float32)
    b.mpi_recv_buffer(y, "in")[...] = host
    b.finish_recv(y, "in")
    b.synchronize()
    assert np.array_equal(cupy.asnumpy(y), host)


# ---------------------------------------------------------------------------------------------
# under mpiexec (tests/_mpi_device.py)


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list[dict]]:
    proc = run_mpi(4, "tests/_mpi_device.py", timeout=60)
    return {r["case"]: r["ranks"] for r in results(proc)}


def errors(ranks: list[dict]) -> set[str]:
    assert all(set(r) == {"error"} for r in ranks), ranks  # every rank raised
    return {r["error"] for r in ranks}


@pytest.mark.mpi
def test_mpi_ping_pong_through_staging_buffers(four_ranks):
    for r in four_ranks["ping-pong"]:
        assert r == {"max_diff": 0.0, "send_buffers": 1, "rounds": 3}, r


@pytest.mark.mpi
def test_mpi_cpu_backend_on_every_rank(four_ranks):
    assert [r["describe"] for r in four_ranks["cpu"]] == ["cpu"] * 4


@pytest.mark.mpi
@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_mpi_missing_cupy_fails_every_rank_alike(four_ranks):
    assert errors(four_ranks["no-cupy"]) == {f"rank 0: {CUPY_MISSING}"}


@pytest.mark.mpi
def test_mpi_bad_settings_fail_every_rank_alike(four_ranks):
    (msg,) = errors(four_ranks["unknown-device"])
    assert msg == "rank 0: grid.device must be one of cpu, cuda; got 'tpu'"
    (msg,) = errors(four_ranks["bad-cuda-aware"])
    assert msg.startswith("rank 0: grid.cuda_aware must be 'auto', true or false")


@pytest.mark.mpi
def test_mpi_gpu_is_local_rank_modulo_gpus(four_ranks):
    staged = not four_ranks["detect"][0]["cuda_aware"]  # "auto" follows this MPI's answer
    for case, staging in (("fake-2-gpus", staged), ("fake-2-gpus-aware", False)):
        ranks = four_ranks[case]
        assert [r["device_id"] for r in ranks] == [0, 1, 0, 1], ranks
        assert [r["used"] for r in ranks] == [0, 1, 0, 1], ranks
        assert all(r["staging"] is staging for r in ranks), ranks
    assert four_ranks["fake-2-gpus-aware"][1]["describe"] == "cuda:1 (CUDA-aware MPI)"


@pytest.mark.mpi
def test_mpi_one_rank_without_cuda_aware_mpi_makes_every_rank_stage(four_ranks):
    assert all(r["staging"] for r in four_ranks["fake-aware-but-rank-2"])


@pytest.mark.mpi
def test_mpi_one_failing_rank_fails_every_rank(four_ranks):
    (msg,) = errors(four_ranks["fake-no-gpu-on-ranks-1-2"])  # first failing rank wins
    assert msg.startswith("rank 1: grid.device = 'cuda' but no CUDA GPU is visible on ")
    (msg,) = errors(four_ranks["fake-use-fails-on-rank-3"])
    assert msg.startswith("rank 3: grid.device = 'cuda': RuntimeError: cudaErrorDevices")
    assert "\n" not in msg  # one line, even from a multi-line exception


@pytest.mark.mpi
def test_mpi_detect_cuda_aware_agrees_across_ranks(four_ranks):
    assert len({r["cuda_aware"] for r in four_ranks["detect"]}) == 1


@pytest.mark.mpi
def test_mpi_local_rank_on_three_ranks():
    proc = run_mpi(3, "tests/_mpi_device.py", "local-rank", timeout=60)
    (line,) = results(proc)
    pairs = sorted((r["node_rank"], r["node_size"]) for r in line["ranks"])
    assert pairs == [(0, 3), (1, 3), (2, 3)]
