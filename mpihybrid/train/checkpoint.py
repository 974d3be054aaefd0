"""Checkpoints: every stage's parameters, optimizer state and error-feedback residuals, atomically.

    DIR/step-000120/manifest.json          written last, by rank 0: what the checkpoint holds
    DIR/step-000120/stage-002.h5           replica 0 of stage 2: params + optimizer state
    DIR/step-000120/residual-s002-r001.h5  replica 1's error-feedback residual of stage 2
    DIR/step-000120/shard-s002-r001.h5     train.shard_optimizer: replica 1's optimizer shard of
                                           stage 2 (its owned ranges, their state, its master)

With a sharded optimizer the stage file holds the parameters only and every replica writes the
state of the chunks it owns. A resume assembles each stage's whole state from the shards (they
must cover it) and takes what its own optimizer needs: dp may change, and a run may go from
sharded to not sharded and back (a lossy weight gather's master copy is the parameters then).

A checkpoint is first written into `DIR/.step-000120.partial-<nonce>/` (each file itself through a
temporary name, fsynced), then rank 0 writes the manifest and renames the directory
(files.commit_dir: the files and the directory fsynced, then the rename): a crash or a kill -9
at any moment leaves the previous checkpoints untouched and at most a `.partial` directory that
readers ignore (the next run removes it: clean_partials). The manifest holds every file's sha256;
a resume checks the files it loads against them and, when the newest checkpoint is damaged,
says so and falls back to the next older one (restore_all). A step-N directory already in the
way of a new checkpoint (a crash before its manifest, or a run resumed from an older one) is
moved aside to `step-N.moved-<nonce>` with a warning, never overwritten. Training draws no
random numbers after initialisation (the data are keyed by the step), so the step is all the
RNG state a resume needs. Every collective here ends with all ranks agreeing: an error one rank
meets (a full disk, a refused rename) is raised as the same CheckpointError on every rank.
"""

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

from mpihybrid.comm.agree import agree, first_error
from mpihybrid.comm.device import copy_from_host, host_array
from mpihybrid.files import atomic_path, commit_dir, write_atomic
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.model import stage_num_params
from mpihybrid.nn.optim import ShardedOptimizer
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


def _write_h5(path: Path, arrays: dict[str, np.ndarray], attrs: dict) -> dict[str, str]:
    """One checkpoint file, atomically; returns {file name: sha256} for the manifest."""
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        for key, value in attrs.items():
            f.attrs[key] = value
        for name, array in arrays.items():
            f.create_dataset(name, data=array)
            progress("checkpoint")
    return {path.name: file_digest(path)}


def save_rank(partial: Path, state, dp_rank: int, step: int) -> dict:
    """This rank's share of a checkpoint of one chunk (a train.state.StageState), into the
    (already created) partial directory. Returns {file name: sha256} of the files it wrote."""
    digests = {}
    s, stage, optimizer, ring = state.index, state.stage, state.optimizer, state.reducer
    sharded = state.sharded
    if sharded:
        digests |= _save_shard(partial, s, dp_rank, optimizer, step)
    if dp_rank == 0:
        # host copies of arrays that may live on a GPU (no copy on the CPU)
        arrays = {"params": host_array(stage.flat_params)}
        if not sharded:
            arrays.update({f"optimizer/{k}": host_array(v) for k, v in optimizer.state().items()})
        digests |= _write_h5(
            partial / f"stage-{s:03d}.h5",
            arrays,
            {"stage": s, "step": step, "optimizer_steps": optimizer.step_count},
        )
    if ring.residual is not None:
        digests |= _write_h5(
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
            best, keep, scores[best],
            ", ".join(f"{scores[p]:.4g}" for p in found[-keep:]),
        )  # fmt: skip
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
    check_shards_cover(manifest, job, path)


def _read_h5(path: Path) -> tuple[dict[str, np.ndarray], dict]:
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


def _check_finite(path: Path, what: str, values: np.ndarray) -> None:
    """A checkpoint never holds nan or inf (a diverged step is never saved): refuse one that
    does."""
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise CheckpointError(f"{path}: {what} hold nan or inf; not a checkpoint this run wrote")


def _verify(path: Path, name: str, manifest: dict) -> None:
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


def load_rank(path: Path, state, *, dp_rank: int, same_dp: bool, manifest=None) -> None:
    """Restore this rank's chunk (a train.state.StageState) in place (residuals only when dp
    and the codec are unchanged), each file first checked against the manifest's digest when
    one is given."""
    s, stage, optimizer, ring = state.index, state.stage, state.optimizer, state.reducer
    _verify(path, f"stage-{s:03d}.h5", manifest or {})
    arrays, attrs = _read_h5(path / f"stage-{s:03d}.h5")
    params = arrays.get("params")
    if params is None or params.shape != stage.flat_params.shape:
        raise CheckpointError(f"{path}: stage {s} parameters do not fit this model")
    _check_finite(path, f"stage {s} parameters", params)
    if (manifest or {}).get("shard_optimizer") or state.sharded:
        _load_sharded(path, s, stage, optimizer, manifest or {}, arrays)
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
            _verify(path, name, manifest or {})
            res, _ = _read_h5(path / name)
            if "residual" not in res or res["residual"].shape != ring.residual.shape:
                raise CheckpointError(f"{path}: {name} holds no residual of this stage's size")
            copy_from_host(ring.residual, res["residual"])
        else:  # each replica's quantisation error is its own; a new dp starts them afresh
            ring.residual[...] = 0.0


def _shard_name(s: int, dp_rank: int) -> str:
    return f"shard-s{s:03d}-r{dp_rank:03d}.h5"


def _save_shard(partial: Path, s: int, dp_rank: int, optimizer, step: int) -> dict:
    """A sharded optimizer's share of stage s: its owned ranges ([lo, hi) rows, in the order
    its state holds them), that state, and its master copy when it keeps one."""
    arrays = {"owned": np.array(optimizer.owned, np.int64).reshape(-1, 2)}
    arrays.update({f"optimizer/{k}": host_array(v) for k, v in optimizer.state().items()})
    if optimizer.master is not None:
        arrays["master"] = host_array(optimizer.master)
    attrs = {"stage": s, "replica": dp_rank, "step": step}
    return _write_h5(partial / _shard_name(s, dp_rank), arrays, attrs)


def _whole_state(path: Path, s: int, n: int, names, manifest: dict, arrays: dict):
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
        name = _shard_name(s, r)
        if (listed is not None and name not in listed) or not (path / name).is_file():
            continue  # the coverage check below says what is missing
        _verify(path, name, manifest)
        shard, _ = _read_h5(path / name)
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
            name = _shard_name(s, r)
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


def _load_sharded(path: Path, s: int, stage, optimizer, manifest: dict, arrays: dict) -> None:
    """Parameters and optimizer state where either side is sharded (re-sharding as needed).
    The weights are the master copy where the checkpoint has one, unless this run keeps a
    master itself (then the working weights and the master are both restored as they were)."""
    n = stage.flat_params.size
    sharded = isinstance(optimizer, ShardedOptimizer)
    names = list(optimizer.state())
    whole, master = _whole_state(path, s, n, names, manifest, arrays)
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


def _agree(world, error: str | None) -> None:
    """Collective: raise the first rank's error on every rank (nothing when none has one)."""
    first = first_error(world, error)
    if first is not None:
        raise CheckpointError(first)


def _write_failed(exc: OSError, root: Path, step: int, needed: int) -> str:
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


def _check_space(root: Path, needed: int) -> None:
    """OSError(ENOSPC) now when the file system holding root has no room for `needed` bytes
    (and HDF5's overhead): a clean refusal instead of a write failing inside HDF5."""
    root.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(root).free < needed + needed // 50 + (1 << 20):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root))


def save_all(
    world, job, states: dict, *, dp_rank: int, step: int, losses: History, accuracies: History
) -> str:
    """Collective: every rank writes its share of its chunks (train.state.StageState) into one
    partial directory; rank 0 commits it. Returns the committed checkpoint's path on every
    rank, or raises the same CheckpointError on every rank (a full disk, a refused rename): the
    partial directory is removed then, and every earlier checkpoint stays as it was."""
    root = Path(job.checkpoint.dir)
    needed = world.allreduce(share_nbytes(dp_rank, states))
    partial, error = None, None
    if world.rank == 0:
        try:
            _check_space(root, needed)
            partial = new_partial(root, step)
        except OSError as exc:
            error = _write_failed(exc, root, step, needed)
    partial, error = world.bcast((partial, error), root=0)
    if error is not None:
        raise CheckpointError(error)
    files, error = {}, None
    try:
        for st in states.values():
            files |= save_rank(partial, st, dp_rank, step)
    except OSError as exc:
        error = _write_failed(exc, root, step, needed)
    shares = world.gather((files, error), root=0)  # every file is in place, or an error says not
    path = None
    if world.rank == 0:
        error = next((e for _, e in shares if e is not None), None)
        try:
            if error is None:
                files = _union(f for f, _ in shares) | keep_tokenizer(job, partial)
                manifest = manifest_for(job, step, losses, accuracies, files)
                path = str(commit(root, partial, step, manifest, job.checkpoint.keep))
                log.info("checkpoint: %s", path)
        except (OSError, CheckpointError) as exc:
            error = (
                str(exc)
                if isinstance(exc, CheckpointError)
                else _write_failed(exc, root, step, needed)
            )
        if path is None:
            shutil.rmtree(partial, ignore_errors=True)
    path, error = world.bcast((path, error), root=0)
    if error is not None:
        raise CheckpointError(error)
    return path


def keep_tokenizer(job, partial: Path) -> dict[str, str]:
    """Rank 0: a copy of the tokenizer beside the job's token files (what `generate` decodes
    with, wherever the data go later); {file name: sha256}, empty when there is none."""
    from mpihybrid.nn.tokenizer import TOKENIZER_FILE, tokenizer_beside

    source = tokenizer_beside(job.data.train) if job.data.kind == "tokens" else None
    if source is None or not source.is_file():
        return {}
    write_atomic(partial / TOKENIZER_FILE, source.read_bytes())
    return {TOKENIZER_FILE: file_digest(partial / TOKENIZER_FILE)}


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


# ---------------------------------------------------------------------------------------------
# whose checkpoint (and trace) is this: the stored job against this one

# What a resume may change and still be the same run: how long it runs, where and how it writes
# its files, the grid's data-parallel width and placement, the ring's wire, the schedule and its
# micro-batches (hybrid == serial: the same sums), whether the optimizer state is sharded and
# whether forwards are recomputed (neither changes a bit). Anything else (the model, the data and
# their seeds, the batch, the optimizer and its settings) makes it another job.
RESUMABLE = (
    "train.steps", "train.schedule", "train.microbatches", "train.early_grad_send",
    "train.shard_optimizer", "train.recompute",
    "grid.dp", "grid.order", "grid.device", "comm.*", "trace.*", "checkpoint.*",
)  # fmt: skip


def job_differences(stored_toml: str, job, ignore: tuple[str, ...] = RESUMABLE) -> list[str]:
    """The settings in which a stored job (a manifest's or a trace's TOML) differs from `job`,
    as 'train.lr = 0.1 there, 0.05 here', leaving out the `ignore`d ones ('section.*' a whole
    section); a stored job that does not parse is one difference."""
    from mpihybrid.config import _toml_value, to_toml, tomllib

    try:
        theirs = tomllib.loads(stored_toml)
    except (tomllib.TOMLDecodeError, TypeError):
        return ["its stored job is not readable TOML"]
    mine = tomllib.loads(to_toml(job))
    found = []
    for section, values in mine.items():
        other = theirs.get(section, {})
        other = other if isinstance(other, dict) else {}
        for key, value in values.items():
            name = f"{section}.{key}"
            if name in ignore or f"{section}.*" in ignore or other.get(key) == value:
                continue
            there = _toml_value(other[key]) if key in other else "(unset)"
            found.append(f"{name} = {there} there, {_toml_value(value)} here")
    return found


def check_trace_owner(path: str | os.PathLike, job) -> None:
    """Refuse (TraceError) to continue the trace at `path` when it is another run's: its
    stored job differs from `job` in more than a resume may change, or it was written with
    another checkpoint.dir (another run's checkpoints). --overwrite replaces it instead."""
    from mpihybrid.config import tomllib
    from mpihybrid.trace.read import TraceError, load

    path = Path(path)
    if not path.is_file():
        return
    config = load(path).config
    ignore = tuple(name for name in RESUMABLE if name != "checkpoint.*")
    found = job_differences(config, job, (*ignore, "checkpoint.every", "checkpoint.keep"))
    found = [line for line in found if not line.startswith("checkpoint.dir ")]
    try:
        theirs = tomllib.loads(config).get("checkpoint", {}).get("dir", "")
    except (tomllib.TOMLDecodeError, AttributeError):
        theirs = None
    mine = job.checkpoint.dir
    if not isinstance(theirs, str) or Path(theirs or ".").resolve() != Path(mine or ".").resolve():
        found.insert(0, f"checkpoint.dir = {theirs!r} there, {mine!r} here")
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise TraceError(
            f"trace {path} is another run's, not this resumed run's: {'; '.join(found[:3])}{more}"
            "; --overwrite replaces it, or choose another --trace path"
        )


def check_same_job(manifest: dict, job, path: Path, force: bool) -> None:
    """Refuse to resume another job's checkpoint (CheckpointError naming the first
    differences) unless `force`; version 1 manifests without a job pass."""
    if force or not isinstance(manifest.get("job"), str):
        return
    found = job_differences(manifest["job"], job)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise CheckpointError(
            f"checkpoint {path} is another job's: {'; '.join(found[:3])}{more}. A resume may "
            f"change only {', '.join(RESUMABLE)}; --force resumes from it anyway, or choose "
            "another checkpoint.dir"
        )
