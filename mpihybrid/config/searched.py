"""A job running a searched schedule (`train.schedule = "auto"`; cli/auto.py searches it for
train, bench train and sweep, predict/searched.py for predict):

    job = apply(job, {"csv": TEXT, "partition": [...], "chunks": 2, "info": JSON}, world_size)

The CSV is registered in this process as `csv:auto@HASH` (the trace keeps it as it keeps any csv:
schedule), the search's JSON beside it (the trace's `schedule_search`), and the job is resolved
again with that schedule, its chunks per rank and its split.
"""

from __future__ import annotations

import dataclasses
import hashlib

from mpihybrid.config import resolve

AUTO_TIME = 4.0  # the exact search's deterministic time limit, over every split it solves (~ s)


def auto_placements(train) -> tuple[str, ...]:
    """The placements "auto" searches: train.schedule_placement's, or loop and V."""
    return (train.schedule_placement,) if train.schedule_placement else ("loop", "v")


def apply(job, payload: dict, world_size: int):
    """The job running the searched schedule: csv:auto@HASH registered here, its split."""
    from mpihybrid.pipeline.csv_schedule import register
    from mpihybrid.pipeline.search import SEARCHES

    text = payload["csv"]
    name = f"csv:auto@{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    register(name, text)
    SEARCHES[name] = payload["info"]
    train = dataclasses.replace(job.train, schedule=name, virtual_stages=payload["chunks"])
    model = dataclasses.replace(job.model, partition=payload["partition"])
    return resolve(dataclasses.replace(job, train=train, model=model), world_size)
