"""Device backend checks under mpiexec; rank 0 prints one line per case: RESULT {"case", "ranks"}.

    mpiexec -n 4 python tests/_mpi_device.py              # every case below but local-rank
    mpiexec -n 3 python tests/_mpi_device.py local-rank

"ranks" holds each rank's outcome: what it returned, or {"error": message} if it raised
DeviceError. The "cuda" cases run with a fake CuPy (FakeCupy), so they need no GPU.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np


class FakeCupy:
    """Just enough of CuPy for select_backend: a GPU count, Device(i).use(), the current stream."""

    def __init__(self, gpus: int, fail_use: bool = False):
        self.used: int | None = None
        self.synchronized = 0

        def device_count() -> int:
            if gpus < 0:  # what CuPy does without a driver or device
                raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
            return gpus

        def use(i: int) -> None:
            if fail_use:
                raise RuntimeError(f"cudaErrorDevicesUnavailable on device {i}\n(second line)")
            self.used = i

        def synchronize() -> None:
            self.synchronized += 1

        stream = SimpleNamespace(synchronize=synchronize)
        self.cuda = SimpleNamespace(
            runtime=SimpleNamespace(getDeviceCount=device_count),
            Device=lambda i: SimpleNamespace(use=lambda: use(i)),
            get_current_stream=lambda: stream,
        )


def outcome(call) -> dict:
    from mpihybrid.comm.device import DeviceError

    try:
        return call()
    except DeviceError as exc:
        return {"error": str(exc)}


def select(device: str, cuda_aware, world, cupy: FakeCupy | None = None) -> dict:
    from mpihybrid.comm.device import select_backend

    def call() -> dict:
        b = select_backend(device, cuda_aware, world, _import_cupy=cupy and (lambda: cupy))
        return {
            "device_id": b.device_id,
            "used": cupy and cupy.used,
            "staging": b.staging,
            "describe": b.describe(),
        }

    return outcome(call)


def ping_pong(world, rounds: int = 3) -> dict:
    """Even rank r sends to r + 1, which sends the message back, through forced host staging."""
    from mpi4py import MPI

    from mpihybrid.comm.device import Backend

    backend = Backend("cpu", np, None, cuda_aware=False, staging=True)
    rank = world.Get_rank()
    peer = rank ^ 1
    if peer >= world.Get_size():
        return {"skipped": True}
    x = backend.empty((5, 7), np.float32)
    send_ids, max_diff = set(), 0.0
    for i in range(rounds):
        req = world.Irecv([backend.mpi_recv_buffer(x, key="in"), MPI.FLOAT], source=peer, tag=i)
        if rank % 2 == 0:
            sent = np.random.default_rng([rank, i]).standard_normal((5, 7)).astype(np.float32)
            send = backend.mpi_send_buffer(backend.asarray(sent), key="out")
            send_ids.add(id(send))
            world.Send([send, MPI.FLOAT], dest=peer, tag=i)
        req.Wait()
        backend.finish_recv(x, key="in")
        if rank % 2 == 1:  # echo the message back
            send = backend.mpi_send_buffer(x, key="out")
            send_ids.add(id(send))
            world.Send([send, MPI.FLOAT], dest=peer, tag=i)
        else:
            max_diff = max(max_diff, float(np.abs(backend.to_host(x) - sent).max()))
    return {"max_diff": max_diff, "send_buffers": len(send_ids), "rounds": rounds}


def main() -> None:
    from mpi4py import MPI

    from mpihybrid.comm.device import detect_cuda_aware, local_rank

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    gpus_or_none = {1: 0, 2: -1}.get(rank, 2)  # rank 1: no GPU; rank 2: no driver
    cases = {
        "cpu": lambda: select("cpu", "auto", world),
        "unknown-device": lambda: select("tpu", "auto", world),
        "bad-cuda-aware": lambda: select("cuda", "yes", world),
        "no-cupy": lambda: select("cuda", "auto", world),
        "fake-2-gpus": lambda: select("cuda", "auto", world, FakeCupy(2)),
        "fake-2-gpus-aware": lambda: select("cuda", True, world, FakeCupy(2)),
        "fake-aware-but-rank-2": lambda: select("cuda", rank != 2, world, FakeCupy(2)),
        "fake-no-gpu-on-ranks-1-2": lambda: select("cuda", "auto", world, FakeCupy(gpus_or_none)),
        "fake-use-fails-on-rank-3": lambda: select("cuda", False, world, FakeCupy(2, rank == 3)),
        "ping-pong": lambda: ping_pong(world),
        "detect": lambda: {"cuda_aware": detect_cuda_aware()},
        "local-rank": lambda: dict(zip(("node_rank", "node_size"), local_rank(world), strict=True)),
    }
    names = sys.argv[1:] or [name for name in cases if name != "local-rank"]
    for name in names:
        ranks = world.gather(cases[name](), root=0)
        if rank == 0:
            print("RESULT " + json.dumps({"case": name, "ranks": ranks}), flush=True)


if __name__ == "__main__":
    main()
