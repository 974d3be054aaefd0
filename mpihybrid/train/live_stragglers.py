"""The live straggler line: at each step line's boundary every rank's mean F, B and W since the
last one go to rank 0, which scores each rank against the fastest replica of its pipeline
position (pipeline/slowdown.py's THRESHOLD and CHRONIC, the rule analyze names stragglers by)
and logs one line the first time a rank becomes a chronic straggler: slow in at least CHRONIC
of the step lines since the first (warm-up) and MIN_LINES of them, and slow over all of them
together (its mean since the first line against its fastest peer's):

    straggler: rank 3 (stage 1) F 1.31x its stage's fastest replica in 4 of 5 step lines

On a host with more ranks than cores the line says that a rank waiting for a core looks slow
for that alone (the quick start's 4 ranks on 2 cores), as analyze does.

    watch = LiveStragglers(); watch.observe(world, runtime, pp_rank)   # collective
"""

from __future__ import annotations

import logging
import os

import numpy as np

from mpihybrid.pipeline.slowdown import CHRONIC, THRESHOLD
from mpihybrid.sysinfo import hostname

log = logging.getLogger("mpihybrid")
KINDS = "FBW"
MIN_LINES = 5  # one slow line is a hiccup; chronic needs a few


class LiveStragglers:
    def __init__(self) -> None:
        self.lines = 0
        self.slow: dict[tuple[int, str], int] = {}
        self.told: set[tuple[int, str]] = set()
        self.last = np.zeros((2, len(KINDS)))
        self.since: np.ndarray | None = None  # every rank's seconds and counts at the first line
        self.caveat = ""  # rank 0: what an oversubscribed host makes of the scores

    def observe(self, world, runtime, pp_rank: int) -> None:
        """Collective over `world`: score the interval since the last call (rank 0 logs)."""
        now = np.array([[runtime.kind_seconds[k][i] for k in KINDS] for i in (0, 1)])
        seconds, count = now - self.last
        self.last = now
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(count > 0, seconds / np.maximum(count, 1), np.nan)
        host = (hostname(), os.cpu_count() or 1) if self.since is None else None
        rows = world.gather((pp_rank, mean, _stages(runtime), now, host), root=0)
        if rows is None:
            return
        totals = np.array([r[3] for r in rows])
        if self.since is None:  # the first line: warm-up (kernels compile, buffers fault in)
            self.since = totals
            self.caveat = _caveat([r[4] for r in rows])
            return
        self.lines += 1
        seconds, count = (totals - self.since).transpose(1, 0, 2)
        overall = np.where(count > 0, seconds / np.maximum(count, 1), np.inf)
        replicas: dict[int, list[int]] = {}  # pp rank -> the world ranks at that position
        for rank, row in enumerate(rows):
            replicas.setdefault(row[0], []).append(rank)
        ref = {}  # pp rank -> (its fastest replica this line, over all lines), once per position
        for position, peers in replicas.items():
            line = np.array([rows[i][1] for i in peers])
            line = np.min(np.where(np.isnan(line), np.inf, line), axis=0)
            ref[position] = (line, np.min(overall[peers], axis=0))
        for rank, (position, means, stages, *_) in enumerate(rows):
            if len(replicas[position]) < 2:
                continue  # one replica: nothing does the same work
            fastest, best = ref[position]
            for k, kind in enumerate(KINDS):
                if not 0 < fastest[k] < np.inf or not means[k] >= THRESHOLD * fastest[k]:
                    continue
                key = (rank, kind)
                self.slow[key] = self.slow.get(key, 0) + 1
                slow = self.slow[key]
                chronic = slow >= MIN_LINES and slow >= CHRONIC * self.lines
                if key not in self.told and chronic and overall[rank][k] >= THRESHOLD * best[k]:
                    self.told.add(key)
                    log.warning(
                        f"straggler: rank {rank} (stage {stages}) {kind} "
                        f"{overall[rank][k] / best[k]:.2f}x its stage's fastest replica, slow in "
                        f"{slow} of {self.lines} step lines{self.caveat}"
                    )


def _caveat(hosts: list[tuple[str, int]]) -> str:
    """ ", but ..." where a host runs more ranks than it has cores, else ""."""
    ranks: dict[str, int] = {}
    for name, _ in hosts:
        ranks[name] = ranks.get(name, 0) + 1
    cores = dict(hosts)
    crowded = [name for name, n in ranks.items() if n > cores[name]]
    if not crowded:
        return ""
    name = crowded[0]
    return (
        f" (but {ranks[name]} ranks share {cores[name]} cores on {name}: a rank waiting for a "
        "core looks slow for that alone)"
    )


def _stages(runtime) -> str:
    return ",".join(str(s) for s in sorted(runtime.stages))
