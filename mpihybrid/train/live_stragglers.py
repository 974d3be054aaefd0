"""The live straggler line: at each step line's boundary every rank's mean F, B and W since the
last one go to rank 0, which scores each rank against the fastest replica of its pipeline
position (pipeline/slowdown.py's THRESHOLD and CHRONIC, the rule analyze names stragglers by)
and logs one line the first time a rank becomes a chronic straggler: slow in at least CHRONIC
of the step lines since the first (warm-up) and MIN_LINES of them, and slow over all of them
together (its mean since the first line against its fastest peer's):

    straggler: rank 3 (stage 1) F 1.31x its stage's fastest replica in 4 of 5 step lines

On a CPU run a rank counts as slow only when its actions' thread CPU time is slow by the same
rule, as analyze counts it: slow on the clock alone, it waited for a core (another process on
its core, more ranks than cores), which is the host's doing; and only when it is slow beyond
its core's speed (train.probe, over the run so far): a rank whose core is as much slower as
its actions is a slower device, not a straggler in its work. On a host with more ranks than
cores the line still says that a rank waiting for a core may look slow for that alone.

    watch = LiveStragglers(); watch.observe(world, runtime, pp_rank, probe)   # collective
"""

from __future__ import annotations

import logging
import os

import numpy as np

from mpihybrid.pipeline.slowdown import CHRONIC, THRESHOLD, beyond_core, core_ratios
from mpihybrid.sysinfo import hostname

log = logging.getLogger("mpihybrid")
KINDS = "FBW"
MIN_LINES = 5  # one slow line is a hiccup; chronic needs a few


class LiveStragglers:
    def __init__(self) -> None:
        self.lines = 0
        self.slow: dict[tuple[int, str], int] = {}
        self.told: set[tuple[int, str]] = set()
        self.last = np.zeros((3, len(KINDS)))  # every kind's seconds, count, CPU seconds
        self.since: np.ndarray | None = None  # every rank's totals at the first line
        self.caveat = ""  # rank 0: what an oversubscribed host makes of the scores

    def observe(self, world, runtime, pp_rank: int, probe=None) -> None:
        """Collective over `world`: score the interval since the last call (rank 0 logs);
        probe: this rank's train.probe.CoreProbe (None: its core's speed is not known)."""
        now = np.array([[runtime.kind_seconds[k][i] for k in KINDS] for i in (0, 1, 2)])
        mean = _means(now - self.last)
        self.last = now
        host = (hostname(), os.cpu_count() or 1) if self.since is None else None
        # this core's probe so far (NaN: not known); a timing is due at most every 50 ms, so a
        # run of short steps has few since the first line
        speed = probe.median() if probe is not None else np.nan
        rows = world.gather((pp_rank, mean, _stages(runtime), now, host, speed), root=0)
        if rows is None:
            return
        totals = np.array([r[3] for r in rows])
        if self.since is None:  # the first line: warm-up (kernels compile, buffers fault in)
            self.since = totals
            self.caveat = _caveat([r[4] for r in rows])
            return
        self.lines += 1
        overall = np.array([_means(t, empty=np.inf) for t in totals - self.since])
        speed = np.array([r[5] for r in rows], dtype=float)
        replicas: dict[int, list[int]] = {}  # pp rank -> the world ranks at that position
        for rank, row in enumerate(rows):
            replicas.setdefault(row[0], []).append(rank)
        for peers in replicas.values():
            if len(peers) < 2:
                continue  # one replica: nothing does the same work
            line = np.array([rows[i][1] for i in peers])  # [peer, wall|cpu, kind]
            best = overall[peers]
            core = core_ratios(speed[peers])
            for j, rank in enumerate(peers):
                for k, kind in enumerate(KINDS):
                    if _slow(line[:, :, k], j, core[j]):
                        score = overall[rank][0][k] / best[:, 0, k].min()
                        self._count(rank, kind, score, _slow(best[:, :, k], j, core[j]), rows)

    def _count(self, rank: int, kind: str, score: float, overall: bool, rows: list) -> None:
        """A slow line for (rank, kind); the first time it is chronic and slow over all the
        lines together (`overall`), one line (rank 0)."""
        key = (rank, kind)
        self.slow[key] = self.slow.get(key, 0) + 1
        slow = self.slow[key]
        chronic = slow >= MIN_LINES and slow >= CHRONIC * self.lines
        if key not in self.told and chronic and overall:
            self.told.add(key)
            log.warning(
                f"straggler: rank {rank} (stage {rows[rank][2]}) {kind} {score:.2f}x its "
                f"stage's fastest replica, slow in {slow} of {self.lines} step lines{self.caveat}"
            )


def _means(totals: np.ndarray, empty: float = np.nan) -> np.ndarray:
    """[wall, cpu] x kind: the mean action's seconds from (seconds, count, cpu seconds)."""
    seconds, count, cpu = totals
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, np.stack([seconds, cpu]) / np.maximum(count, 1), empty)


def _slow(means: np.ndarray, j: int, core: float = 1.0) -> bool:
    """Peer j's mean (row j of [peer, wall|cpu]) is THRESHOLD x the fastest peer's on the
    clock, and in CPU time too where the run measures it (NaN: a GPU's), and still so with
    its core's slowness (`core`: its probe over the fastest peer's) taken out."""
    wall, cpu = means[:, 0], means[:, 1]
    fastest = np.min(np.where(np.isnan(wall), np.inf, wall))
    if not 0 < fastest < np.inf or not wall[j] >= THRESHOLD * fastest:
        return False
    if np.isnan(cpu).any():
        return bool(wall[j] >= beyond_core(core) * fastest)
    return bool(cpu[j] >= beyond_core(core) * np.min(cpu))


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
