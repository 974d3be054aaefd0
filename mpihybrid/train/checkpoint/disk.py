"""A checkpoint on disk: its directory and files (HDF5, each written atomically), their sha256
digests, the manifest, the commit (manifest last, then the rename), pruning, and the one-line
errors a file system's refusal becomes."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import h5py
import numpy as np

from mpihybrid.files import atomic_path, commit_dir, write_atomic
from mpihybrid.progress import progress
from mpihybrid.train.history import History
from mpihybrid.units import human_bytes

log = logging.getLogger("mpihybrid")


FORMAT = "mpihybrid-checkpoint"


VERSION = 2  # 2: the manifest holds every file's sha256 ("files")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line for the user."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose contents changed after it was written (or never landed in full):
    a resume falls back to the next older one."""


STEP_NAME = re.compile(r"step-\d{6,}")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def complete(root: str | Path) -> list[Path]:
    """Every complete checkpoint under root (a step-N directory with its manifest), oldest
    first; directories moved aside (step-N.moved-...) do not count."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if STEP_NAME.fullmatch(p.name)]
    return sorted(p for p in found if (p / "manifest.json").is_file())


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under root (None when there is none)."""
    found = complete(root)
    return found[-1] if found else None


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (what the manifest records and a resume checks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
            progress("checkpoint")
    return digest.hexdigest()


def write_h5(path: Path, arrays: dict[str, np.ndarray], attrs: dict) -> dict[str, str]:
    """One checkpoint file, atomically; returns {file name: sha256} for the manifest."""
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        for key, value in attrs.items():
            f.attrs[key] = value
        for name, array in arrays.items():
            f.create_dataset(name, data=array)
            progress("checkpoint")
    return {path.name: file_digest(path)}


def new_partial(root: Path, step: int) -> Path:
    partial = root / f".step-{step:06d}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir(parents=True)
    return partial


def clean_partials(root: str | Path) -> list[Path]:
    """Remove the partial directories crashed runs left under root; returns what was removed.
    (Two jobs must not share one checkpoint.dir: this would remove the other's.)"""
    root = Path(root)
    stale = sorted(p for p in root.glob(".step-*.partial-*") if p.is_dir()) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _move_aside(final: Path) -> Path:
    """A step-N directory in the way of a new checkpoint keeps its contents under a new name."""
    aside = final.with_name(f"{final.name}.moved-{uuid.uuid4().hex[:8]}")
    what = "complete" if (final / "manifest.json").is_file() else "incomplete: no manifest"
    os.rename(final, aside)
    log.warning("checkpoint %s already existed (%s); moved it aside to %s", final, what, aside)
    return aside


def commit(root: Path, partial: Path, step: int, manifest: dict, keep: int) -> Path:
    """Rank 0, after every rank wrote its files: manifest last, rename, prune old ones."""
    final = step_dir(root, step)
    write_atomic(partial / "manifest.json", json.dumps(manifest, indent=1))
    if final.exists():  # a crash between rename and manifest, or a run resumed from older
        _move_aside(final)
    commit_dir(partial, final)  # every file fsynced, the directory renamed, its parent fsynced
    for old in prunable(complete(root), keep):
        shutil.rmtree(old, ignore_errors=True)
    return final


BEST_WINDOW = 10  # a checkpoint's loss: the mean of the last this many steps' losses before it


def prunable(found: list[Path], keep: int) -> list[Path]:
    """The checkpoints to delete (oldest first) so that the newest `keep` remain, and also the
    best one: the lowest mean loss over its last BEST_WINDOW steps. A run whose loss explodes
    but stays finite (no nan to stop it) would otherwise prune every good checkpoint."""
    old = found[: max(len(found) - keep, 0)]
    scores = {path: _score(path) for path in found}
    finite = [path for path in found if math.isfinite(scores[path])]
    best = min(finite, key=lambda path: (scores[path], -found.index(path)), default=None)
    if best in old:
        log.warning(
            "checkpoint %s is kept beyond checkpoint.keep = %d: its loss (%.4g) is the best, "
            "and the newer ones' are higher (%s)",
            best,
            keep,
            scores[best],
            ", ".join(f"{scores[p]:.4g}" for p in found[-keep:]),
        )
    return [path for path in old if path != best]


def _score(path: Path) -> float:
    """The mean loss of a checkpoint's last steps (inf when unreadable or none)."""
    try:
        losses = read_manifest(path).get("losses") or []
        tail = [float(x) for x in losses[-BEST_WINDOW:]]
    except (CheckpointError, TypeError, ValueError):
        return math.inf
    return sum(tail) / len(tail) if tail and all(map(math.isfinite, tail)) else math.inf


def manifest_for(job, step: int, losses: History, accuracies: History, files: dict) -> dict:
    """files: {file name: sha256} of every file the ranks wrote; the losses and accuracies of
    the last History.KEEP steps, from step losses_from (0-based)."""
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
        "shard_optimizer": job.train.shard_optimizer,
        "losses": losses.kept(),
        "accuracies": accuracies.kept(),
        "losses_from": losses.first,
        "job": to_toml(job),
        "files": dict(sorted(files.items())),
    }


MAX_MANIFEST_BYTES = 1 << 28  # a manifest lists a loss per step: 256 MiB is ~10 M steps


def read_manifest(path: Path) -> dict:
    try:
        size = (path / "manifest.json").stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"checkpoint {path}: manifest.json is {size} bytes; not ours")
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointDamaged(f"checkpoint {path}: manifest unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not an mpihybrid checkpoint")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(
            f"checkpoint {path}: version {manifest['version']} is newer than this mpihybrid "
            f"reads ({VERSION}); upgrade mpihybrid"
        )
    return manifest


def read_h5(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Every dataset of a checkpoint file (reached by plain links) and its root attributes;
    each dataset checked before it is read (_readable_datasets)."""
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not an mpihybrid checkpoint file")
            datasets = _readable_datasets(path, f)
            return {name: ds[()] for name, ds in datasets.items()}, dict(f.attrs)
    except CheckpointError:
        raise
    except (OSError, KeyError) as exc:
        raise CheckpointDamaged(f"{path}: unreadable or torn checkpoint file ({exc})") from None


MAX_DATASETS = 64  # a checkpoint file holds params, a few optimizer buffers or one residual


def _readable_datasets(path: Path, f: h5py.File) -> dict[str, h5py.Dataset]:
    """The datasets of a checkpoint file, refused (CheckpointError) when any keeps its data
    outside the file (external storage, a virtual dataset: the sha256 would not cover it) or
    declares more than the file holds: nothing is allocated for a size the file does not back."""
    from mpihybrid.files import h5_dataset_problem

    found: dict[str, h5py.Dataset] = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            found[name] = obj
        return None if len(found) <= MAX_DATASETS else True

    f.visititems(visit)
    if len(found) > MAX_DATASETS:
        raise CheckpointError(f"{path}: more than {MAX_DATASETS} datasets; not a checkpoint file")
    size = path.stat().st_size
    for name, ds in found.items():
        problem = h5_dataset_problem(ds, size)
        if problem:
            raise CheckpointError(f"{path}: dataset {name} {problem}")
    return found


def check_finite(path: Path, what: str, values: np.ndarray) -> None:
    """A checkpoint never holds nan or inf (a diverged step is never saved): refuse one that
    does."""
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise CheckpointError(f"{path}: {what} hold nan or inf; not a checkpoint this run wrote")


def verify(path: Path, name: str, manifest: dict) -> None:
    """The file's sha256 against the manifest's (version 1 checkpoints have none to check)."""
    files = manifest.get("files")
    if files is None:
        return
    if name not in files:
        raise CheckpointDamaged(f"checkpoint {path}: {name} is not in its manifest")
    try:
        ok = file_digest(path / name) == files[name]
    except OSError as exc:
        raise CheckpointDamaged(f"checkpoint {path}: {name} unreadable ({exc.strerror})") from None
    if not ok:
        raise CheckpointDamaged(
            f"checkpoint {path}: {name} is damaged (its sha256 differs from the manifest's)"
        )


def write_failed(exc: OSError, root: Path, step: int, needed: int) -> str:
    """One line for a checkpoint the file system refused (a full disk above all)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        free = shutil.disk_usage(root).free if root.is_dir() else 0
        room = f", {human_bytes(free)} free" if free < needed else ""
        reason = (
            f"no space left on its device ({human_bytes(needed)} needed for this checkpoint{room})"
        )
    return (
        f"checkpoint for step {step} not written to {root}: {reason}; earlier checkpoints are kept"
    )


def check_space(root: Path, needed: int) -> None:
    """OSError(ENOSPC) now when the file system holding root has no room for `needed` bytes
    (and HDF5's overhead): a clean refusal instead of a write failing inside HDF5."""
    root.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(root).free < needed + needed // 50 + (1 << 20):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root))


def keep_tokenizer(job, partial: Path) -> dict[str, str]:
    """Rank 0: a copy of the tokenizer beside the job's token files (what `generate` decodes
    with, wherever the data go later); {file name: sha256}, empty when there is none."""
    from mpihybrid.nn.tokenizer import TOKENIZER_FILE, tokenizer_beside

    source = tokenizer_beside(job.data.train) if job.data.kind == "tokens" else None
    if source is None or not source.is_file():
        return {}
    write_atomic(partial / TOKENIZER_FILE, source.read_bytes())
    return {TOKENIZER_FILE: file_digest(partial / TOKENIZER_FILE)}
