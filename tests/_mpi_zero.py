"""The distributed optimizer and recomputation, checked in one launch; rank 0 prints RESULT lines.

    mpiexec -n 4 python tests/_mpi_zero.py --dps 2,3,4 --dir /tmp/zero

For each dp in --dps the world is split into a communicator of dp ranks (pp = 1; with --pp2 also
pp = 2 on all four) and every job trains on it; the others wait. Per layout, one RESULT line:
    sharded_fp32      max |sharded fp32 - unsharded| (must be 0: the update is elementwise)
    recompute         max |recompute full - none| (0)
    int8 / bf16       replica_max_diff of a lossy weight gather (0) and its last loss
    resume_*          max |resumed - uninterrupted| after checkpoint round trips (0)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpihybrid.config import load_job  # noqa: E402
from mpihybrid.train.loop import train  # noqa: E402
from tests.helpers import abort_on_exception  # noqa: E402

sys.excepthook = abort_on_exception

parser = argparse.ArgumentParser()
parser.add_argument("--dps", default="2,3,4")
parser.add_argument("--dir", required=True)
args = parser.parse_args()
world = MPI.COMM_WORLD

# awkward sizes: hidden 19 and 7-element buckets' chunks do not divide by 3 or 4
BASE = [
    "grid.pp=1", "model.depth=4", "model.hidden=19", "data.features=13", "train.steps=4",
    "train.microbatches=2", "train.optimizer=adamw", "train.lr=0.01", "train.weight_decay=0.1",
    "comm.bucket_kb=1", "comm.segment_kb=1", "comm.block=16", "trace.path=",
]  # fmt: skip


def run(comm, extra, resume=None):
    pp = 2 if "grid.pp=2" in extra else 1
    dp = comm.Get_size() // pp
    job = load_job(None, [*BASE, f"train.global_batch={dp * 2 * 3}", *extra], comm.Get_size())
    s = train(job, comm, quiet=True, collect_params=True, resume_from=resume)
    if s is None:
        return None
    return np.concatenate(s.params), s.losses, max(s.replica_max_diff.values())


def state_elements(comm, extra):
    """Optimizer state elements on this rank (summed over the ranks of comm) after 1 step."""
    from mpihybrid.comm.device import select_backend
    from mpihybrid.train.build import build_run

    pp = 2 if "grid.pp=2" in extra else 1
    dp = comm.Get_size() // pp
    job = load_job(
        None, [*BASE, f"train.global_batch={dp * 2 * 3}", *extra, "train.steps=0"], comm.Get_size()
    )
    run = build_run(job, comm, select_backend("cpu", False, comm))
    mine = sum(v.size for st in run.states.values() for v in st.optimizer.state().values())
    run.gradcomm.close()
    run.grid.free()
    return comm.allreduce(mine)


def diff(a, b):
    return float(np.max(np.abs(a[0] - b[0])))


def layout(comm, tag, pp_extra):
    ckpt = os.path.join(args.dir, tag)
    plain = run(comm, [*pp_extra])
    sharded = run(comm, [*pp_extra, "train.shard_optimizer=true"])
    recompute = run(comm, [*pp_extra, "train.recompute=full", "train.schedule=zb-h1"])
    plain_zb = run(comm, [*pp_extra, "train.schedule=zb-h1"])
    int8 = run(comm, [*pp_extra, "train.shard_optimizer=true", "comm.param_codec=int8",
                      "comm.codec=int8"])  # fmt: skip
    bf16 = run(comm, [*pp_extra, "train.shard_optimizer=true", "comm.param_codec=bf16"])
    # a sharded run's checkpoint at step 2, resumed sharded and not: both as if never stopped
    every = ["checkpoint.every=2", f"checkpoint.dir={ckpt}-s", "checkpoint.keep=1"]
    run(comm, [*pp_extra, "train.shard_optimizer=true", *every, "train.steps=2"])
    step2 = f"{ckpt}-s/step-000002"
    back_sharded = run(comm, [*pp_extra, "train.shard_optimizer=true"], resume=step2)
    back_plain = run(comm, [*pp_extra], resume=step2)
    # an int8 weight gather's checkpoint resumed as it was: the same bits as never stopped
    lossy = [*pp_extra, "train.shard_optimizer=true", "comm.param_codec=int8"]
    every_l = ["checkpoint.every=2", f"checkpoint.dir={ckpt}-l", "checkpoint.keep=1"]
    run(comm, [*lossy, *every_l, "train.steps=2"])
    uninterrupted_l = run(comm, lossy)
    back_lossy = run(comm, lossy, resume=f"{ckpt}-l/step-000002")
    plain_state = state_elements(comm, [*pp_extra])
    sharded_state = state_elements(comm, [*pp_extra, "train.shard_optimizer=true"])
    if plain is None:
        return
    out = {
        "layout": tag,
        "sharded_fp32": diff(plain, sharded),
        "sharded_replicas": sharded[2],
        "recompute": diff(plain_zb, recompute),
        "int8_replicas": int8[2],
        "bf16_replicas": bf16[2],
        "int8_vs_fp32": diff(int8, plain),
        "state_ratio": sharded_state / plain_state,
        "int8_loss": int8[1][-1],
        "bf16_loss": bf16[1][-1],
        "fp32_loss": plain[1][-1],
        "resume_sharded": diff(back_sharded, plain),
        "resume_plain": diff(back_plain, plain),
        "resume_int8": diff(back_lossy, uninterrupted_l),
    }
    print("RESULT " + json.dumps(out), flush=True)


if world.rank == 0:
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
world.Barrier()
for dp in map(int, args.dps.split(",")):
    sub = world.Split(0 if world.rank < dp else MPI.UNDEFINED, world.rank)
    if sub != MPI.COMM_NULL:
        layout(sub, f"dp{dp}", [f"grid.dp={dp}"])
        sub.Free()
    world.Barrier()
if world.Get_size() == 4:
    layout(world, "pp2dp2", ["grid.pp=2", "grid.dp=2"])
# re-sharding across dp: dp=4's sharded checkpoint resumed at dp=3, sharded and not, must agree
if world.Get_size() == 4:
    sub = world.Split(0 if world.rank < 3 else MPI.UNDEFINED, world.rank)
    if sub != MPI.COMM_NULL:
        step2 = os.path.join(args.dir, "dp4-s", "step-000002")
        a = run(sub, ["grid.dp=3", "train.shard_optimizer=true"], resume=step2)
        b = run(sub, ["grid.dp=3"], resume=step2)
        if a is not None:
            print("RESULT " + json.dumps({"layout": "dp4->3", "reshard": diff(a, b)}), flush=True)
        sub.Free()
    world.Barrier()
