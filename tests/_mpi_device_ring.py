"""The ring on device arrays (tests/fakegpu, host staging); rank 0 prints one RESULT per codec.

    mpiexec -n 2 python tests/_mpi_device_ring.py

The same inputs go through the ring on the host and on the fake device: the results must be the
same bits, and what crossed to the host during the device call must be the bytes the ring sent
(encoded), not the float32 vector.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpihybrid.comm.allreduce import RingAllreduce  # noqa: E402
from mpihybrid.comm.codecs import CODECS, get_codec  # noqa: E402
from mpihybrid.comm.device import select_backend  # noqa: E402
from mpihybrid.comm.settings import RingSettings  # noqa: E402
from tests import fakegpu  # noqa: E402

world = MPI.COMM_WORLD
backend = select_backend("cuda", False, world, _import_cupy=lambda: fakegpu)
COUNT = 50_001
for name in CODECS:
    x = np.random.default_rng([world.rank, 3]).standard_normal(COUNT).astype(np.float32)
    host = x.copy()
    host_ring = RingAllreduce(world, COUNT, RingSettings(get_codec(name), segment=4096))
    for _ in range(2):  # twice: the second call carries the first one's residual
        host[:] = x
        host_ring(host)
    device = fakegpu.asarray(x)
    ring = RingAllreduce(world, COUNT, RingSettings(get_codec(name), segment=4096, backend=backend))
    ring(device)
    device[...] = fakegpu.asarray(x)
    before = fakegpu.counts["to_host_bytes"]
    sent = ring(device)
    copied = fakegpu.counts["to_host_bytes"] - before
    result = {
        "codec": name,
        "same_bits": bool(np.array_equal(device.get(), host)),
        "to_host_bytes": copied,
        "sent_bytes": sent,
        "vector_bytes": 4 * COUNT,
        "residual_on_device": ring.residual is None or type(ring.residual) is fakegpu.DeviceArray,
    }
    # the ring's host staging is its own (named per ring, not by id(), which a later ring may
    # get once this one is freed) and goes with close()
    staged = {key[1][:2] for key in backend._staged}
    ring.close()
    result["staging_dropped"] = ring._name in staged and not any(
        key[1][:2] == ring._name for key in backend._staged
    )
    results = world.gather(result, root=0)
    if world.rank == 0:
        print("RESULT " + json.dumps({"codec": name, "ranks": results}), flush=True)
