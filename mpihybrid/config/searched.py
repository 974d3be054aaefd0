"""A job running a searched schedule (`train.schedule = "auto"`; cli/auto.py searches it for
train, bench train and sweep, predict/searched.py for predict):

    job = apply(job, {"csv": TEXT, "partition": [...], "chunks": 2, "info": JSON}, world_size)

The schedule is named `csv:auto@HASH`; the job carries its CSV and the search's JSON
(Job.searched), which its schedule value (Job.schedule) takes and the trace keeps
(`schedule_csv`, `schedule_search`); the job is resolved again with that schedule, its chunks
per rank and its split.
"""

from __future__ import annotations

import dataclasses
import hashlib

from mpihybrid.config import Searched, resolve

# a solve ends once its best is proved within 1 % of the optimum: half the margin a searched
# order must win by (search.TIE_MARGIN), so a closer proof changes no choice auto makes
AUTO_GAP = 0.01


def auto_placements(train) -> tuple[str, ...]:
    """The placements "auto" searches: train.schedule_placement's, or loop and V."""
    return (train.schedule_placement,) if train.schedule_placement else ("loop", "v")


def apply(job, payload: dict, world_size: int):
    """The job running the searched schedule: named csv:auto@HASH, its CSV and the search's
    record carried by the job (Job.searched: its schedule value takes them), its split."""
    text = payload["csv"]
    name = f"csv:auto@{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    found = Searched(name=name, csv=text, record=payload["info"])
    train = dataclasses.replace(job.train, schedule=name, virtual_stages=payload["chunks"])
    model = dataclasses.replace(job.model, partition=payload["partition"])
    job = dataclasses.replace(job, train=train, model=model, searched=found)
    return resolve(job, world_size)
