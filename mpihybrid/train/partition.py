"""`model.partition = "timed"`: the split measured on this machine, fixed once before a run.

The blocks are timed (nn.profile.timed_block_costs: forward + input and weight gradients of
each block per micro-batch, the loss with the head, on the job's own micro-batches, the whole
model as one stage) and split by the schedule's placement (nn.model.balanced_for_ranks: the
busiest pp rank's total as small as possible, where a V or an interleaved schedule gives a rank
several chunks). The job then runs with that split as an explicit list of layer counts, so the
trace, checkpoints, analysis and predict read a list like any other. A run that resumes keeps
the split of its newest checkpoint: timing again could split otherwise, and the stored weights
would not fit the stages.

    job = resolve_partition(job)        # rank 0; `mpihybrid train` then broadcasts the list
"""

from __future__ import annotations

import dataclasses

from mpihybrid.config import tomllib
from mpihybrid.nn.model import balanced_for_ranks, layer_counts
from mpihybrid.nn.profile import timed_block_costs


def timed_counts(job, repeats: int = 3) -> tuple[list[int], list[float]]:
    """(layer counts per chunk, seconds per block) of the placement-balanced timed split."""
    costs = timed_block_costs(job.workload, repeats)
    placement = job.schedule.placement
    rank_of = [placement.rank_of(c) for c in range(job.workload.chunks)]
    ranges = balanced_for_ranks(costs, rank_of)
    return layer_counts(job.model, ranges), costs


def stored_counts(job) -> list[int] | None:
    """The layer counts of the newest complete checkpoint in checkpoint.dir, if it has any."""
    from mpihybrid.train.checkpoint import CheckpointError, latest, read_manifest

    if not job.checkpoint.dir:
        return None
    path = latest(job.checkpoint.dir)
    if path is None:
        return None
    try:
        stored = tomllib.loads(read_manifest(path).get("job") or "")
    except (CheckpointError, tomllib.TOMLDecodeError):
        return None  # the resume's own checks say what is wrong with it
    counts = stored.get("model", {}).get("partition")
    return counts if isinstance(counts, list) else None


def resolve_partition(job, repeats: int = 3):
    """The job with "timed" replaced by its layer counts (any other partition: as it is)."""
    if job.model.partition != "timed":
        return job
    counts = stored_counts(job) or timed_counts(job, repeats)[0]
    return dataclasses.replace(job, model=dataclasses.replace(job.model, partition=counts))
