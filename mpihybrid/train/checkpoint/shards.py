"""The sharded optimizer's share of a checkpoint (train.shard_optimizer, ZeRO-1): each replica
writes the state of the chunks it owns; a resume assembles a stage's whole state from every
shard (they must cover it) and takes what its own optimizer needs, sharded or not, at any dp."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from mpihybrid.comm.device import copy_from_host, host_array
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.model import stage_num_params
from mpihybrid.nn.optim import ShardedOptimizer
from mpihybrid.train.checkpoint import disk
from mpihybrid.train.checkpoint.disk import CheckpointError, read_h5, verify


def shard_name(s: int, dp_rank: int) -> str:
    return f"shard-s{s:03d}-r{dp_rank:03d}.h5"


def save_shard(partial: Path, s: int, dp_rank: int, optimizer, step: int) -> dict:
    """A sharded optimizer's share of stage s: its owned ranges ([lo, hi) rows, in the order
    its state holds them), that state, and its master copy when it keeps one."""
    arrays = {"owned": np.array(optimizer.owned, np.int64).reshape(-1, 2)}
    arrays.update({f"optimizer/{k}": host_array(v) for k, v in optimizer.state().items()})
    if optimizer.master is not None:
        arrays["master"] = host_array(optimizer.master)
    attrs = {"stage": s, "replica": dp_rank, "step": step}
    return disk.write_h5(partial / shard_name(s, dp_rank), arrays, attrs)


def _whole_state(path: Path, s: int, n: int, names, manifest: dict, *, arrays: dict):
    """The whole stage's optimizer state {name: array of n} and the master weights (None when
    the checkpoint has none): from the stage file, or assembled from every replica's shard.
    CheckpointError when the shards leave part of the stage uncovered."""
    if not manifest.get("shard_optimizer"):
        whole = {}
        for name in names:
            saved = arrays.get(f"optimizer/{name}")
            if saved is None or saved.shape != (n,):
                raise CheckpointError(f"{path}: optimizer state {name!r} missing or mis-shaped")
            whole[name] = saved
        return whole, None
    whole = {name: np.zeros(n, np.float32) for name in names}
    master, covered = None, np.zeros(n, bool)
    listed = manifest.get("files")
    for r in range(int(manifest["dp"])):
        name = shard_name(s, r)
        if (listed is not None and name not in listed) or not (path / name).is_file():
            continue  # the coverage check below says what is missing
        verify(path, name, manifest)
        shard, _ = read_h5(path / name)
        at = 0
        for lo, hi in shard.get("owned", np.empty((0, 2), np.int64)).tolist():
            if not 0 <= lo <= hi <= n:
                raise CheckpointError(f"{path}: {name} holds range [{lo}, {hi}) outside stage {s}")
            for key in names:
                saved = shard.get(f"optimizer/{key}")
                if saved is None or saved.size < at + hi - lo:
                    raise CheckpointError(f"{path}: {name} lacks optimizer state {key!r}")
                whole[key][lo:hi] = saved[at : at + hi - lo]
            if "master" in shard:
                master = np.zeros(n, np.float32) if master is None else master
                master[lo:hi] = shard["master"][at : at + hi - lo]
            covered[lo:hi] = True
            at += hi - lo
    _refuse_uncovered(path, manifest, s, covered)
    return whole, master


def _refuse_uncovered(path: Path, manifest: dict, s: int, covered: np.ndarray) -> None:
    if not covered.all():
        gap = int(np.argmin(covered))
        raise CheckpointError(
            f"checkpoint {path}: the optimizer shards of stage {s} cover "
            f"{int(covered.sum())} of its {covered.size} parameters (missing from offset {gap}; "
            f"{manifest['dp']} shards expected)"
        )


def check_shards_cover(manifest: dict, job, path: Path) -> None:
    """A sharded checkpoint's shard files (as its manifest lists them) must cover every stage:
    checked from their owned ranges alone (rank 0 before a run, and again by each resume)."""
    if not manifest.get("shard_optimizer"):
        return
    sizes = stage_num_params(
        job.model, *task_dims(job.data), job.grid.pp * job.train.virtual_stages
    )
    listed = manifest.get("files")
    for s, n in enumerate(sizes):
        covered = np.zeros(n, bool)
        for r in range(int(manifest["dp"])):
            name = shard_name(s, r)
            if (listed is not None and name not in listed) or not (path / name).is_file():
                continue
            try:
                with h5py.File(path / name, "r") as f:
                    owned = f["owned"][()] if "owned" in f else np.empty((0, 2), np.int64)
            except (OSError, KeyError):
                continue  # unreadable: the resume's digest check says it is damaged
            for lo, hi in owned.tolist():
                covered[max(lo, 0) : min(hi, n)] = True
        _refuse_uncovered(path, manifest, s, covered)


def load_sharded(path: Path, s: int, stage, optimizer, manifest: dict, *, arrays: dict) -> None:
    """Parameters and optimizer state where either side is sharded (re-sharding as needed).
    The weights are the master copy where the checkpoint has one, unless this run keeps a
    master itself (then the working weights and the master are both restored as they were)."""
    n = stage.flat_params.size
    sharded = isinstance(optimizer, ShardedOptimizer)
    names = list(optimizer.state())
    whole, master = _whole_state(path, s, n, names, manifest, arrays=arrays)
    params = arrays["params"]
    keeps_master = sharded and optimizer.master is not None
    copy_from_host(stage.flat_params, params if master is None or keeps_master else master)
    if sharded:
        for name, buf in optimizer.state().items():
            shard = np.empty(buf.shape, np.float32)
            optimizer.gather(whole[name], shard)
            copy_from_host(buf, shard)
        if keeps_master:
            optimizer.load_master(params if master is None else master)
    else:
        for name, buf in optimizer.state().items():
            copy_from_host(buf, whole[name])
