"""Every rank's chunks (train.state.StageState) into one checkpoint and back, collectively:
save_all writes each rank's share into one partial directory and rank 0 commits it; restore_all
loads the newest intact checkpoint of a list, falling back past damaged ones."""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict
from pathlib import Path

from mpihybrid.comm.agree import agree, rank0_decides
from mpihybrid.comm.device import copy_from_host, host_array
from mpihybrid.nn.kinds import model_kind
from mpihybrid.train.checkpoint import disk
from mpihybrid.train.checkpoint.disk import (
    CheckpointDamaged,
    CheckpointError,
    check_finite,
    check_space,
    commit,
    keep_tokenizer,
    manifest_for,
    new_partial,
    read_h5,
    read_manifest,
    verify,
    write_failed,
)
from mpihybrid.train.checkpoint.shards import check_shards_cover, load_sharded, save_shard
from mpihybrid.train.history import History

log = logging.getLogger("mpihybrid")


def save_rank(partial: Path, state, dp_rank: int, step: int) -> dict:
    """This rank's share of a checkpoint of one chunk (a train.state.StageState), into the
    (already created) partial directory. Returns {file name: sha256} of the files it wrote."""
    digests = {}
    s, stage, optimizer, ring = state.index, state.stage, state.optimizer, state.reducer
    sharded = state.sharded
    if sharded:
        digests |= save_shard(partial, s, dp_rank, optimizer, step)
    if dp_rank == 0:
        # host copies of arrays that may live on a GPU (no copy on the CPU)
        arrays = {"params": host_array(stage.flat_params)}
        if not sharded:
            arrays.update({f"optimizer/{k}": host_array(v) for k, v in optimizer.state().items()})
        digests |= disk.write_h5(
            partial / f"stage-{s:03d}.h5",
            arrays,
            {"stage": s, "step": step, "optimizer_steps": optimizer.step_count},
        )
    if ring.residual is not None:
        digests |= disk.write_h5(
            partial / f"residual-s{s:03d}-r{dp_rank:03d}.h5",
            {"residual": host_array(ring.residual)},
            {"stage": s, "replica": dp_rank, "step": step},
        )
    return digests


def share_nbytes(dp_rank: int, states: dict) -> int:
    """Bytes of array data this rank writes into one checkpoint (what a full disk is told)."""
    total = 0
    for st in states.values():
        optimizer, residual = st.optimizer, st.reducer.residual
        if dp_rank == 0:
            total += st.stage.flat_params.nbytes
        if dp_rank == 0 or st.sharded:
            total += sum(v.nbytes for v in optimizer.state().values())
        if st.sharded and optimizer.master is not None:
            total += optimizer.master.nbytes
        if residual is not None:
            total += residual.nbytes
    return total


def check_compatible(manifest: dict, job, path: Path) -> None:
    """Refuse a checkpoint from another model, pipeline shape or optimizer (dp may differ)."""
    mine = {
        "pp": job.grid.pp,
        "virtual_stages": job.train.virtual_stages,
        "model": asdict(job.model),
        "features": job.data.features,
        "optimizer": job.train.optimizer,
    }
    theirs = bool((manifest.get("model") or {}).get("vocab_parallel", False))
    if theirs != job.model.vocab_parallel:  # the chunks differ: the shares hold wte and the head
        raise CheckpointError(
            f"checkpoint {path} was written with model.vocab_parallel = {str(theirs).lower()}, "
            f"this job has {str(job.model.vocab_parallel).lower()}: its chunks hold the table "
            "and the head differently (resume with the same setting; weights export, then "
            "model.init, carries the weights across)"
        )
    _check_chunking(manifest, job, path)
    for key, value in mine.items():
        theirs = manifest.get(key)
        if key == "model" and isinstance(theirs, dict):  # the weights hold model.init's start
            older = asdict(type(job.model)())  # a setting added since: its default there
            theirs, value = _without_init({**older, **theirs}), _without_init(value)
            if theirs != value:  # the first key that differs, once
                name = next(k for k in sorted({*theirs, *value}) if theirs.get(k) != value.get(k))
                key, theirs, value = f"model.{name}", theirs.get(name), value.get(name)
        if theirs != value:
            raise CheckpointError(
                f"checkpoint {path} has {key} = {theirs!r} but this job has {value!r}"
            )
    if manifest["step"] > job.train.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {manifest['step']}, past train.steps = {job.train.steps}"
        )
    check_shards_cover(manifest, job, path)


def _check_chunking(manifest: dict, job, path: Path) -> None:
    """A checkpoint's stages are its placement's chunks: another pp or chunks per rank (a V
    schedule's 2 after a loop's 1) is refused naming both and, for a kind a weights file starts
    (nn/kinds.py: ModelKind.weights), the way across."""
    theirs = (manifest.get("pp"), manifest.get("virtual_stages"))
    mine = (job.grid.pp, job.train.virtual_stages)
    if theirs == mine:
        return
    across = ""
    if model_kind(job.model.kind).weights is not None:  # its weights export starts a job
        across = (
            f"; to go across, `mpihybrid weights export {path.parent} -o W.safetensors`, then "
            "start this job in another checkpoint.dir with model.init = W.safetensors (the "
            "weights, not the optimizer state)"
        )
    raise CheckpointError(
        f"checkpoint {path} holds pp = {theirs[0]} x {theirs[1]} chunk(s) per rank and this job "
        f"runs {job.train.schedule} at pp = {mine[0]} x {mine[1]}: a checkpoint resumes only "
        f"under a schedule of its own placement and chunks{across}"
    )


def _without_init(model: dict) -> dict:
    return {k: v for k, v in model.items() if k != "init"}


def load_rank(path: Path, state, *, dp_rank: int, same_dp: bool, manifest=None) -> None:
    """Restore this rank's chunk (a train.state.StageState) in place (residuals only when dp
    and the codec are unchanged), each file first checked against the manifest's digest when
    one is given."""
    s, stage, optimizer, ring = state.index, state.stage, state.optimizer, state.reducer
    verify(path, f"stage-{s:03d}.h5", manifest or {})
    arrays, attrs = read_h5(path / f"stage-{s:03d}.h5")
    params = arrays.get("params")
    if params is None or params.shape != stage.flat_params.shape:
        raise CheckpointError(f"{path}: stage {s} parameters do not fit this model")
    check_finite(path, f"stage {s} parameters", params)
    if (manifest or {}).get("shard_optimizer") or state.sharded:
        load_sharded(path, s, stage, optimizer, manifest or {}, arrays=arrays)
    else:
        copy_from_host(stage.flat_params, params)
        for name, buf in optimizer.state().items():
            saved = arrays.get(f"optimizer/{name}")
            if saved is None or saved.shape != buf.shape:
                raise CheckpointError(f"{path}: optimizer state {name!r} missing or mis-shaped")
            copy_from_host(buf, saved)
    if "optimizer_steps" not in attrs:
        raise CheckpointDamaged(f"{path}: stage {s} file lacks its optimizer_steps attribute")
    optimizer.step_count = int(attrs["optimizer_steps"])
    if ring.residual is not None:
        if same_dp:
            name = f"residual-s{s:03d}-r{dp_rank:03d}.h5"
            verify(path, name, manifest or {})
            res, _ = read_h5(path / name)
            if "residual" not in res or res["residual"].shape != ring.residual.shape:
                raise CheckpointError(f"{path}: {name} holds no residual of this stage's size")
            copy_from_host(ring.residual, res["residual"])
        else:  # each replica's quantisation error is its own; a new dp starts them afresh
            ring.residual[...] = 0.0


def save_all(
    world, job, states: dict, *, dp_rank: int, step: int, losses: History, accuracies: History
) -> str:
    """Collective: every rank writes its share of its chunks (train.state.StageState) into one
    partial directory; rank 0 commits it. Returns the committed checkpoint's path on every
    rank, or raises the same CheckpointError on every rank (a full disk, a refused rename): the
    partial directory is removed then, and every earlier checkpoint stays as it was."""
    root = Path(job.checkpoint.dir)
    needed = world.allreduce(share_nbytes(dp_rank, states))

    def refused(exc: BaseException) -> str:  # one line: a full disk says how much was needed
        if isinstance(exc, CheckpointError):
            return str(exc)
        return write_failed(exc, root, step, needed)

    def make_partial() -> Path:
        check_space(root, needed)
        return new_partial(root, step)

    partial, error = rank0_decides(world, make_partial, expected=(OSError,), describe=refused)
    if error is not None:
        raise CheckpointError(error)
    files, error = {}, None
    try:
        for st in states.values():
            files |= save_rank(partial, st, dp_rank, step)
    except OSError as exc:
        error = refused(exc)
    shares = world.gather((files, error), root=0)  # every file is in place, or an error says not

    def commit_shares() -> str:  # rank 0: the partial directory committed, or removed
        try:
            if failed := next((e for _, e in shares if e is not None), None):
                raise CheckpointError(failed)
            files = _union(f for f, _ in shares) | keep_tokenizer(job, partial)
            manifest = manifest_for(job, step, losses, accuracies, files)
            path = str(commit(root, partial, step, manifest, job.checkpoint.keep))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        log.info("checkpoint: %s", path)
        return path

    path, error = rank0_decides(
        world, commit_shares, expected=(OSError, CheckpointError), describe=refused
    )
    if error is not None:
        raise CheckpointError(error)
    return path


def _union(parts) -> dict:
    out: dict = {}
    for part in parts:
        out |= part
    return out


def _restore_one(world, job, path: Path, states: dict, dp_rank: int) -> dict:
    """Collective: load checkpoint `path` on every rank; CheckpointDamaged on every rank when
    any rank found it damaged, CheckpointError when any found it unusable. Returns the manifest."""
    error, damaged, manifest = None, False, None
    try:
        manifest = read_manifest(path)
        check_compatible(manifest, job, path)
        same = manifest["dp"] == job.grid.dp and manifest["codec"] == job.comm.codec
        for st in states.values():
            load_rank(path, st, dp_rank=dp_rank, same_dp=same, manifest=manifest)
    except CheckpointError as exc:
        error, damaged = str(exc), isinstance(exc, CheckpointDamaged)
    found, damages = agree(world, error, damaged)
    refused = [e for r, e in found if not damages[r]]
    if refused:  # another model, pp or optimizer: no older checkpoint is any better
        raise CheckpointError(refused[0])
    if found:
        raise CheckpointDamaged(found[0][1])
    return manifest


def restore_all(world, job, candidates, states: dict, *, dp_rank: int):
    """Collective: resume this rank's chunks (train.state.StageState) from the newest intact
    checkpoint of `candidates` (newest first; one path is a list of one). A damaged one is
    reported and the next older one tried; every rank agrees on each verdict. Returns (step,
    losses, accuracies); CheckpointError on every rank when none is intact or one is refused."""
    candidates = [candidates] if isinstance(candidates, (str, Path)) else list(candidates)
    damaged = []
    for path in map(Path, candidates):
        try:
            manifest = _restore_one(world, job, path, states, dp_rank)
        except CheckpointDamaged as exc:
            damaged.append(str(exc))
            if world.rank == 0:
                log.warning("%s; trying the next older checkpoint", exc)
            continue
        if world.rank == 0:
            log.info("resumed from %s (step %d)", path, manifest["step"])
        first = int(manifest.get("losses_from", 0))  # a run past KEEP steps kept its last
        return (
            manifest["step"],
            History(manifest["losses"], first),
            History(manifest["accuracies"], first),
        )
    where = Path(candidates[0]).parent if candidates else job.checkpoint.dir
    raise CheckpointError(f"no intact checkpoint to resume from in {where}: " + "; ".join(damaged))
