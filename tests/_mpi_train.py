"""Run `train()` under mpiexec for one or more schedules; rank 0 prints one JSON line per run.

    mpiexec -n 4 python tests/_mpi_train.py --schedules gpipe,1f1b --set grid.pp=2 ...

With --serial, rank 0 also trains the serial reference and reports the largest difference.
With --also SECTION.KEY=VALUE (repeatable), every schedule runs again with that setting added
(its results carry "also": the setting), in the same launch.
With --fake-gpu, arrays live on tests/fakegpu's strict stand-in for a GPU, and MPI reaches them
through host staging (grid.device = "cuda", comm.cuda_aware = false, without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpihybrid.cli.auto import resolve_auto  # noqa: E402
from mpihybrid.config import load_job  # noqa: E402
from mpihybrid.nn.data import build_task  # noqa: E402
from mpihybrid.nn.model import build_stage  # noqa: E402
from mpihybrid.nn.vocab_weights import unsplit, whole_tensors  # noqa: E402
from mpihybrid.nn.weights import export_tensors  # noqa: E402
from mpihybrid.train.loop import train  # noqa: E402
from mpihybrid.train.tie import bind_local  # noqa: E402
from tests.helpers import abort_on_exception  # noqa: E402
from tests.serial_reference import train_serial  # noqa: E402

sys.excepthook = abort_on_exception

parser = argparse.ArgumentParser()
parser.add_argument("--job", default=None)
parser.add_argument("--schedules", default="1f1b")
parser.add_argument("--set", dest="overrides", action="append", default=[])
parser.add_argument("--serial", action="store_true")
parser.add_argument("--fake-gpu", action="store_true")
parser.add_argument("--also", action="append", default=[])
args = parser.parse_args()

world = MPI.COMM_WORLD
backend = None
if args.fake_gpu:
    from mpihybrid.comm.device import select_backend
    from tests import fakegpu

    backend = select_backend("cuda", False, world, _import_cupy=lambda: fakegpu)


def vocab_tensors(job, params, serial_flat):
    """model.vocab_parallel: (hybrid, serial) as every nanoGPT-named tensor, concatenated."""
    task = build_task(job.data)
    cfg = unsplit(job.model)
    whole = whole_tensors(job.model, task.in_features, task.num_classes, params, job.grid.pp)
    stage = build_stage(cfg, task.in_features, task.num_classes, 0, 1, seed=0)
    stage.flat_params[...] = serial_flat
    bind_local([stage], cfg)
    reference = export_tensors([stage], cfg.depth + 2)
    assert sorted(reference) == sorted(whole), (sorted(reference), sorted(whole))
    names = sorted(reference)
    return (np.concatenate([whole[n].ravel() for n in names]),
            np.concatenate([reference[n].ravel() for n in names]))  # fmt: skip


runs = [(name, also) for also in ["", *args.also] for name in args.schedules.split(",")]
for name, also in runs:
    overrides = [*args.overrides, f"train.schedule={name}", *([also] if also else [])]
    if name == "interleaved-1f1b":
        overrides.append("train.virtual_stages=2")
    job = resolve_auto(load_job(args.job, overrides, world.Get_size()), world)  # "auto": search
    summary = train(job, world, quiet=True, collect_params=args.serial, backend=backend)
    if world.rank != 0:
        continue
    out = {
        "schedule": name,
        "also": also,
        "losses": summary.losses,
        "test_accuracy": summary.test_accuracy,
        "replica_max_diff": max(summary.replica_max_diff.values()),
        "bytes_sent": summary.bytes_sent,
        "peak_inflight": summary.peak_inflight,
        "device": backend.describe() if backend else "cpu",
    }
    if args.fake_gpu:
        out["copies"] = dict(fakegpu.counts)
    if args.serial:
        norms = []
        if job.model.vocab_parallel:  # the whole model's tensors, gathered, against serial's
            serial, serial_losses = train_serial(replace(job, model=unsplit(job.model)), norms)
            hybrid, serial = vocab_tensors(job, summary.params, serial)
        else:
            hybrid = np.concatenate(summary.params)
            serial, serial_losses = train_serial(job, norms)
        out["serial_norms"] = norms
        out["norms"] = summary.extra.get("grad_norms", [])
        out["max_abs_diff"] = float(np.max(np.abs(hybrid - serial)))
        out["allclose"] = bool(np.allclose(hybrid, serial, rtol=1e-5, atol=1e-6))
        out["serial_losses"] = serial_losses
    print("RESULT " + json.dumps(out), flush=True)
