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

from mpihybrid.train.checkpoint.disk import (
    FORMAT,
    VERSION,
    CheckpointDamaged,
    CheckpointError,
    clean_partials,
    commit,
    complete,
    file_digest,
    latest,
    manifest_for,
    new_partial,
    prunable,
    read_manifest,
    step_dir,
)
from mpihybrid.train.checkpoint.owner import (
    RESUMABLE,
    check_same_job,
    check_trace_owner,
    job_differences,
)
from mpihybrid.train.checkpoint.stages import (
    check_compatible,
    load_rank,
    restore_all,
    save_all,
    save_rank,
    share_nbytes,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointDamaged",
    "CheckpointError",
    "RESUMABLE",
    "check_compatible",
    "check_same_job",
    "check_trace_owner",
    "clean_partials",
    "commit",
    "complete",
    "file_digest",
    "job_differences",
    "latest",
    "load_rank",
    "manifest_for",
    "new_partial",
    "prunable",
    "read_manifest",
    "restore_all",
    "save_all",
    "save_rank",
    "share_nbytes",
    "step_dir",
]
