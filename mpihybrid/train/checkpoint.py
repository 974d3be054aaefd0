"""Checkpoints: every stage's parameters, optimizer state and error-feedback residuals, atomically.

    DIR/step-000120/manifest.json          written last, by rank 0: what the checkpoint holds
    DIR/step-000120/stage-002.h5           replica 0 of stage 2: params + optimizer state
    DIR/step-000120/residual-s002-r001.h5  replica 1's error-feedback residual of stage 2

A checkpoint is first written into `DIR/.step-000120.partial-<nonce>/` (each file itself through a
temporary name, fsynced), then rank 0 writes the manifest and renames the directory
(files.commit_dir: the files and the directory fsynced, then the rename): a crash or a kill -9
at any moment leaves the previous checkpoints untouched and at most a `.partial` directory that
readers ignore. Training draws no random numbers after initialisation (the data are keyed by the
step), so the step is all the RNG state a resume needs.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import h5py
import numpy as np

from mpihybrid.comm.device import copy_from_host, host_array
from mpihybrid.files import atomic_path, commit_dir, write_atomic

log = logging.getLogger("mpihybrid")

FORMAT = "mpihybrid-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line for the user."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _write_h5(path: Path, arrays: dict[str, np.ndarray], attrs: dict) -> None:
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        for key, value in attrs.items():
            f.attrs[key] = value
        for name, array in arrays.items():
            f.create_dataset(name, data=array)


def save_rank(partial: Path, s: int, dp_rank: int, stage, optimizer, ring, step: int) -> None:
    """This rank's share of a checkpoint, into the (already created) partial directory."""
    if dp_rank == 0:
        # host copies of arrays that may live on a GPU (no copy on the CPU)
        arrays = {"params": host_array(stage.flat_params)}
        arrays.update({f"optimizer/{k}": host_array(v) for k, v in optimizer.state().items()})
        _write_h5(
            partial / f"stage-{s:03d}.h5",
            arrays,
            {"stage": s, "step": step, "optimizer_steps": optimizer.step_count},
        )
    if ring.residual is not None:
        _write_h5(
            partial / f"residual-s{s:03d}-r{dp_rank:03d}.h5",
            {"residual": ring.residual},
            {"stage": s, "replica": dp_rank, "step": step},
        )


def new_partial(root: Path, step: int) -> Path:
    partial = root / f".step-{step:06d}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir(parents=True)
    return partial


def commit(root: Path, partial: Path, step: int, manifest: dict, keep: int) -> Path:
    """Rank 0, after every rank wrote its files: manifest last, rename, prune old ones."""
    final = step_dir(root, step)
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists; refusing to overwrite it")
    write_atomic(partial / "manifest.json", json.dumps(manifest, indent=1))
    commit_dir(partial, final)  # every file fsynced, the directory renamed, its parent fsynced
    complete = sorted(p for p in root.glob("step-*") if (p / "manifest.json").is_file())
    for old in complete[: max(len(complete) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def manifest_for(job, step: int, losses: list[float], accuracies: list[float]) -> dict:
    from mpihybrid.config import to_toml

    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "pp": job.grid.pp,
        "dp": job.grid.dp,
        "virtual_stages": job.train.virtual_stages,
        "model": asdict(job.model),
        "features": job.data.features,
        "optimizer": job.train.optimizer,
        "codec": job.comm.codec,
        "losses": losses,
        "accuracies": accuracies,
        "job": to_toml(job),
    }


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under root (None when there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = sorted(p for p in root.glob("step-*") if (p / "manifest.json").is_file())
    return complete[-1] if complete else None


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: manifest unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not an mpihybrid checkpoint")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(
            f"checkpoint {path}: version {manifest['version']} is newer than this mpihybrid "
            f"reads ({VERSION}); upgrade mpihybrid"
        )
    return manifest


def check_compatible(manifest: dict, job, path: Path) -> None:
    """Refuse a checkpoint from another model, pipeline shape or optimizer (dp may differ)."""
    mine = {
        "pp": job.grid.pp,
        "virtual_stages": job.train.virtual_stages,
        "model": asdict(job.model),
        "features": job.data.features,
        "optimizer": job.train.optimizer,
    }
    for key, value in mine.items():
        if manifest.get(key) != value:
            raise CheckpointError(
                f"checkpoint {path} has {key} = {manifest.get(key)!r} but this job has {value!r}"
            )
    if manifest["step"] > job.train.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {manifest['step']}, past train.steps = {job.train.steps}"
        )


def _read_h5(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not an mpihybrid checkpoint file")
            arrays = {}
            f.visititems(
                lambda name, obj: (
                    arrays.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
                )
            )
            return arrays, dict(f.attrs)
    except CheckpointError:
        raise
    except (OSError, KeyError) as exc:
        raise CheckpointError(f"{path}: unreadable or torn checkpoint file ({exc})") from None


def load_rank(path: Path, s: int, dp_rank: int, same_dp: bool, stage, optimizer, ring) -> None:
    """Restore this rank's stage `s` in place (residuals only when dp is unchanged)."""
    arrays, attrs = _read_h5(path / f"stage-{s:03d}.h5")
    params = arrays.get("params")
    if params is None or params.shape != stage.flat_params.shape:
        raise CheckpointError(f"{path}: stage {s} parameters do not fit this model")
    copy_from_host(stage.flat_params, params)
    for name, buf in optimizer.state().items():
        saved = arrays.get(f"optimizer/{name}")
        if saved is None or saved.shape != buf.shape:
            raise CheckpointError(f"{path}: optimizer state {name!r} missing or mis-shaped")
        copy_from_host(buf, saved)
    optimizer.step_count = int(attrs["optimizer_steps"])
    if ring.residual is not None:
        if same_dp:
            res, _ = _read_h5(path / f"residual-s{s:03d}-r{dp_rank:03d}.h5")
            ring.residual[...] = res["residual"]
        else:  # each replica's quantisation error is its own; a new dp starts them afresh
            ring.residual[...] = 0.0


def save_all(world, dp_rank, job, step, stages, optimizers, rings, losses, accuracies) -> str:
    """Collective: every rank writes its share into one partial directory; rank 0 commits it.
    Returns the committed checkpoint's path on every rank."""
    root = Path(job.checkpoint.dir)
    partial = world.bcast(str(new_partial(root, step)) if world.rank == 0 else None)
    for s, st in stages.items():
        save_rank(Path(partial), s, dp_rank, st, optimizers[s], rings[s], step)
    world.Barrier()  # every file is in place before the manifest says so
    path = None
    if world.rank == 0:
        manifest = manifest_for(job, step, losses, accuracies)
        path = str(commit(root, Path(partial), step, manifest, job.checkpoint.keep))
        log.info("checkpoint: %s", path)
    return world.bcast(path, root=0)


def restore_all(world, dp_rank, job, path, stages, optimizers, rings):
    """Collective: load every stage of this rank; all ranks agree on success (or raise the
    first rank's CheckpointError) before training goes on. Returns (step, losses, accuracies)."""
    error = None
    try:
        manifest = read_manifest(Path(path))
        check_compatible(manifest, job, Path(path))
        same = manifest["dp"] == job.grid.dp and manifest["codec"] == job.comm.codec
        for s, st in stages.items():
            load_rank(Path(path), s, dp_rank, same, st, optimizers[s], rings[s])
    except CheckpointError as exc:
        error = str(exc)
    errors = [e for e in world.allgather(error) if e is not None]
    if errors:
        raise CheckpointError(errors[0])
    if world.rank == 0:
        log.info("resumed from %s (step %d)", path, manifest["step"])
    return manifest["step"], list(manifest["losses"]), list(manifest["accuracies"])
