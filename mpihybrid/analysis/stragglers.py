"""Stragglers: per rank and action kind, how much slower it ran than the fastest rank doing the
same work (its stage's replicas: the relative score) and than its own best steps (the
individual score), step by step; one-off or chronic; what it costs (from the replay).

    found = stragglers(trace.events, steps, dp, probe)   # {"scores": [...], "named": [...]}

A (rank, stage, kind) is slow in a step when its median action that step is at least
THRESHOLD times the fastest replica of its stage in that step (the relative score; it needs
dp > 1). It is chronic when slow in at least CHRONIC of the measured steps, one-off when slow
in fewer; analyze names only the chronic ones. The individual score (a step against its own
best steps: the 10th percentile of its per-step medians) is reported, never named on: with
one replica a loaded machine slows every rank's steps together, which is no rank's fault. A
median is not moved by the one action of a step that carries the optimizer's update.

Where the trace has the actions' thread CPU time (a CPU run, schema version 3), a step counts
as slow only when the CPU time is slow by the same rule: a rank whose wall time is slow and
whose CPU time is not waited for a core (another process, or more ranks than cores), which is
the host's doing, not the rank's work; it is reported as such ("waited"), never named. Where
the trace has every rank's core speed (`core_probe_s`, train.probe), a step counts as slow only
when the rank is slow beyond its core's speed against its replicas' cores (slowdown.beyond_core:
THRESHOLD x its core's ratio to the power 1 + PROBE_FIT): a rank whose core is
as much slower as its actions is a slower device ("device": reported with what it costs, never
named as a straggler in its work) where its core is at least half of that slowness (in log:
1.15x actions on a 1.07x core); a step slow by less than that beyond its core counts as healthy.
"""

from __future__ import annotations

import numpy as np

from mpihybrid.analysis.rows import groups
from mpihybrid.pipeline.slowdown import CHRONIC, THRESHOLD, beyond_core, core_ratios
from mpihybrid.trace.recorder import COMPUTE

BEST = 10  # the individual reference: this percentile of its own steps


def stragglers(events: np.ndarray, steps: list[int], dp: int, probe=None) -> dict:
    """Scores per (rank, stage, kind) over `steps` (0-based) and the chronic stragglers;
    probe: each world rank's core speed (seconds of train.probe's product), or None."""
    rows = events[np.isin(events["kind"], list(COMPUTE)) & np.isin(events["step"], steps)]
    rows = rows[rows["stage"] >= 0]
    if not len(rows):
        return {"scores": [], "named": [], "threshold": THRESHOLD, "chronic": CHRONIC}
    keys, key_of = groups(rows["rank"], rows["stage"], rows["kind"], rows["step"])
    wall = _cells(keys, _group_median(key_of, rows["end"] - rows["start"], len(keys)))
    cpu = _cells(keys, _group_median(key_of, rows["cpu"], len(keys)))
    wall_fastest, cpu_fastest = _fastest(wall), _fastest(cpu)
    cores = _cores(wall, probe)
    scores = []
    for (rank, stage, kind), per in sorted(wall.items()):
        values = np.array(list(per.values()))
        best = float(np.percentile(values, BEST))
        individual = values / best if best > 0 else np.ones_like(values)
        relative = cpu_relative = None
        slow = waited = device = 0
        core = cores.get((rank, stage), 1.0)
        if dp > 1:
            relative = np.array([per[s] / wall_fastest[(stage, kind, s)] for s in per])
            mine = cpu[(rank, stage, kind)]
            with np.errstate(invalid="ignore", divide="ignore"):
                cpu_relative = np.array([mine[s] / cpu_fastest[(stage, kind, s)] for s in per])
            known = np.isfinite(cpu_relative)  # NaN: no CPU time (a GPU run, an older trace)
            on_cpu = ~known | (cpu_relative >= THRESHOLD)
            score = np.where(known, cpu_relative, relative)
            work = score >= beyond_core(core)
            # the core explains the step where it is at least half its slowness (in log)
            by_core = np.log(core) >= 0.5 * np.log(np.maximum(score, 1.0))
            late = relative >= THRESHOLD
            slow = int(np.sum(late & on_cpu & work))
            device = int(np.sum(late & on_cpu & ~work & by_core))
            waited = int(np.sum(late & ~on_cpu))
        verdict = (
            _verdict(slow, waited, device, len(values)) if relative is not None else "no peers"
        )
        scores.append(
            {
                "rank": rank,
                "stage": stage,
                "kind": COMPUTE[kind],
                "relative": float(np.median(relative)) if relative is not None else None,
                "cpu_relative": _median_or_none(cpu_relative),
                "core": core if probe is not None and relative is not None else None,
                "individual": float(np.median(individual)),
                "slow_steps": slow,
                "waited_steps": waited,
                "device_steps": device,
                "steps": len(values),
                "verdict": verdict,
            }
        )
    named = sorted((s for s in scores if s["verdict"] == "chronic"), key=lambda s: -s["relative"])
    return {
        "scores": scores,
        "named": named,
        "devices": _devices(scores),
        "threshold": THRESHOLD,
        "chronic": CHRONIC,
    }


def _devices(scores: list[dict]) -> list[dict]:
    """The ranks slow by their core's speed alone, a row each: {rank, stage, core, kinds}."""
    slower: dict[tuple[int, int], dict] = {}
    for s in scores:
        if s["verdict"] == "device":
            row = slower.setdefault(
                (s["rank"], s["stage"]),
                {"rank": s["rank"], "stage": s["stage"], "core": s["core"], "kinds": {}},
            )
            row["kinds"][s["kind"]] = s["relative"]
    return sorted(slower.values(), key=lambda d: -d["core"])


def _cells(keys: np.ndarray, med: np.ndarray) -> dict[tuple[int, int, int], dict[int, float]]:
    """{(rank, stage, kind): {step: the group's median}}."""
    cells: dict[tuple[int, int, int], dict[int, float]] = {}
    for (rank, stage, kind, step), value in zip(keys.tolist(), med.tolist(), strict=True):
        cells.setdefault((rank, stage, kind), {})[step] = value
    return cells


def _cores(wall: dict, probe) -> dict[tuple[int, int], float]:
    """{(rank, stage): its core's probe over the fastest core among its stage's replicas}."""
    if probe is None:
        return {}
    ranks: dict[int, set[int]] = {}
    for rank, stage, _ in wall:
        ranks.setdefault(stage, set()).add(rank)
    cores = {}
    for stage, peers in ranks.items():
        order = sorted(peers)
        for rank, core in zip(order, core_ratios([probe[r] for r in order]), strict=True):
            cores[(rank, stage)] = float(core)
    return cores


def _fastest(cells: dict) -> dict[tuple[int, int, int], float]:
    """The fastest replica of each (stage, kind, step) (NaN where none is known)."""
    fastest: dict[tuple[int, int, int], float] = {}
    for (_, stage, kind), per in cells.items():
        for step, value in per.items():
            key = (stage, kind, step)
            fastest[key] = np.fmin(fastest.get(key, np.nan), value)
    return fastest


def _median_or_none(values: np.ndarray | None) -> float | None:
    if values is None or not np.isfinite(values).any():
        return None
    return float(np.median(values[np.isfinite(values)]))


def _group_median(group: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """The median of `values` in each group (one sort, no mask per group)."""
    order = np.lexsort((values, group))
    counts = np.bincount(group, minlength=n)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    ordered = values[order]
    return 0.5 * (ordered[first + (counts - 1) // 2] + ordered[first + counts // 2])


def _verdict(slow: int, waited: int, device: int, steps: int) -> str:
    if slow >= CHRONIC * steps:
        return "chronic"
    if waited + device + slow >= CHRONIC * steps:
        # slow on the wall clock, not in CPU time: it waited for a core; slow in CPU time as
        # much as its core is slower than its replicas': a slower device
        return "device" if device > waited else "waited"
    return "one-off" if slow or waited or device else "healthy"


def straggler_cost(base, named: dict) -> dict:
    """The step with the straggler at its peers' speed (its kind scaled by 1 / its relative
    score, through the replay; a slower device: each of its slow kinds) against the step
    replayed as run."""
    from mpihybrid.analysis.replay import Change, replay

    if "kinds" in named:  # a slower device: every kind it is slow in, at its peers' speed
        scales = {("rank", named["rank"], k): 1.0 / r for k, r in named["kinds"].items()}
    else:
        scales = {("rank", named["rank"], named["kind"]): 1.0 / named["relative"]}
    now = replay(base, Change())["step"]
    healed = replay(base, Change(scales=scales))["step"]
    return {"now": now, "at_peers_speed": healed, "costs": now - healed}


def straggler_lines(found: dict) -> list[str]:
    """The named stragglers, a line each, or a line saying there is none."""
    how = (
        f"(slow: its median action >= {found['threshold']:g}x the stage's fastest replica's; "
        f"chronic: in >= {found['chronic']:.0%} of the steps)"
    )
    if not found["named"]:
        scores = found["scores"]
        if scores and all(s["relative"] is None for s in scores):
            top = max(scores, key=lambda s: s["individual"])
            return [
                "straggler       none named: one replica, so no rank does another's work; "
                f"against its own best steps the slowest is rank {top['rank']} {top['kind']} "
                f"of stage {top['stage']}, {top['individual']:.2f}x (median)"
            ]
        one_off = sum(1 for s in scores if s["verdict"] == "one-off")
        extra = f"; {one_off} one-off slow rank x kind" if one_off else ""
        return [
            f"straggler       none {how}{extra}",
            *_waited_lines(scores),
            *_device_lines(found.get("devices", [])),
        ]
    lines = []
    for s in found["named"]:
        score, which = s["relative"], "its stage's fastest replica"
        lines.append(
            f"straggler       rank {s['rank']} {s['kind']} of stage {s['stage']}: "
            f"{score:.2f}x {which} in {s['slow_steps']} of {s['steps']} steps "
            f"(chronic){_cost_words(s.get('cost'))}"
        )
    lines.append(f"                {how}")
    lines += _waited_lines(found["scores"])
    lines += _device_lines(found.get("devices", []))
    over = found.get("oversubscribed")
    if over:  # replicas then wait for a core by turns: a rank can lag its peers for many steps
        lines.append(
            f"                caveat: {over['ranks']} ranks on {over['cores']} cores: a rank that "
            "waits for a core looks slow, so these may be the machine's, not the rank's"
        )
    return lines


def _cost_words(cost: dict | None) -> str:
    if not cost:
        return ""
    return (
        f"; at its peers' speed the step would take {1e3 * cost['at_peers_speed']:.2f} ms "
        f"instead of {1e3 * cost['now']:.2f} ms ({-cost['costs'] / cost['now']:+.1%})"
    )


def _device_lines(devices: list[dict]) -> list[str]:
    """The ranks slow by their core alone: a slower device, not their work (not named)."""
    lines = []
    for d in devices:
        kinds = ", ".join(f"{k} {r:.2f}x" for k, r in d["kinds"].items())
        lines.append(
            f"                rank {d['rank']} of stage {d['stage']}: {kinds} its stage's fastest "
            f"replica, and its core {d['core']:.2f}x as slow (the core probe): a slower device, "
            f"not its work{_cost_words(d.get('cost'))}"
        )
    return lines


def _waited_lines(scores: list[dict]) -> list[str]:
    """The rank x kinds slow on the wall clock only: they waited for a core (not named)."""
    lines = []
    for s in sorted(scores, key=lambda s: -(s["relative"] or 0)):
        if s["verdict"] == "waited":
            lines.append(
                f"                rank {s['rank']} {s['kind']} of stage {s['stage']} took "
                f"{s['relative']:.2f}x its stage's fastest replica on the clock but "
                f"{s['cpu_relative']:.2f}x in CPU time: it waited for a core (another process "
                "on its core, or more ranks than cores), the host's doing, not the rank's"
            )
    return lines
