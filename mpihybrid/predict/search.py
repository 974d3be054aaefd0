"""The recommender: every layout of a job for its world size, predicted on a cluster, the ones
that fit ranked by throughput, each with the reason it wins or loses.

    ranked = search(job, load_cluster("a100_80gb"), world=16)
    ranked[0]["set"]      # ["grid.pp=4", "grid.dp=4", ...]: `--set` strings that make it

The space (the job's global batch, model and data kept):
    grid         every pp x dp = world; grid.order both ways when pp > 1 and dp > 1
    schedule     every registered schedule (pipeline.schedules.SCHEDULES: the V schedules and
                 zero-bubble ones too), with 1 or 2 model chunks per rank where the schedule
                 takes them; pp = 1: 1f1b (one stage has no schedule to choose)
    M            1, 2, 4, ..., 64 and the job's own, where global_batch divides into dp x M
    comm         dp > 1: every codec x comm.bucket_kb in BUCKETS_KB and the job's own; where a
                 stage's replicas span nodes, comm.ring flat and auto (two-level); where a
                 pipeline link crosses nodes, every comm.p2p_codec
A layout the job's rules refuse (a schedule's M, a model too shallow for its chunks) is left out
as training would refuse it. The pipeline (its simulation) is computed once per layout and
reused across codecs and buckets, which change only the gradients' rings.
"""

from __future__ import annotations

import dataclasses
import itertools

from mpihybrid.comm.codecs import CODECS
from mpihybrid.comm.layout import ORDERS
from mpihybrid.config import ConfigError, Job, resolve
from mpihybrid.pipeline.schedules import SCHEDULES, ScheduleError, chunks_for
from mpihybrid.predict.cluster import Cluster
from mpihybrid.predict.model import pipeline, predict
from mpihybrid.predict.wire import p2p_encoded, two_level

BUCKETS_KB = (256, 1024, 4096, 16384)
MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)


class SearchError(ValueError):
    """No layout of the job can be made for this world size (one line, exit 2)."""


def _replace(job: Job, **sections: dict) -> Job:
    return dataclasses.replace(
        job, **{k: dataclasses.replace(getattr(job, k), **v) for k, v in sections.items()}
    )


def _pipelines(job: Job, world: int):
    """(grid, train) overrides of every pipeline layout, as dicts of section -> fields."""
    for pp in (p for p in range(1, world + 1) if world % p == 0):
        dp = world // pp
        alone = job.grid.order if job.grid.order != "auto" else "pipeline-inner"
        orders = ORDERS if pp > 1 and dp > 1 else (alone,)
        every = dict.fromkeys((s, chunks_for(s, v)) for s in SCHEDULES for v in (1, 2))
        schedules = list(every) if pp > 1 else [("1f1b", 1)]  # zb-v: 2 chunks, once
        counts = sorted(set(MICROBATCHES) | {job.train.microbatches})
        for order, (name, v), m in itertools.product(orders, schedules, counts):
            if job.train.global_batch % (dp * m):
                continue
            yield {
                "grid": {"pp": pp, "dp": dp, "order": order},
                "train": {"schedule": name, "virtual_stages": v, "microbatches": m},
            }


def _comms(job: Job, base: Job, cluster: Cluster):
    """The gradient ring's settings to try on one pipeline layout (codec, buckets, ring)."""
    if base.grid.dp == 1:
        return [{}]
    buckets = sorted(set(BUCKETS_KB) | {job.comm.bucket_kb})
    spans = any(two_level(_with_ring(base, "auto"), r, cluster) for r in range(base.grid.pp))
    rings = ("auto", "flat") if spans else (base.comm.ring,)
    return [{"codec": c, "bucket_kb": b, "ring": r} for c in CODECS for b in buckets for r in rings]


def _with_ring(job: Job, ring: str) -> Job:
    return _replace(job, comm={"ring": ring})


def _wires(base: Job, cluster: Cluster) -> list[str]:
    """The pipeline wire's codecs to try: all of them where a link would be encoded."""
    if base.grid.pp == 1 or not p2p_encoded(_replace(base, comm={"p2p_codec": "bf16"}), cluster):
        return [base.comm.p2p_codec]
    return list(CODECS)


def set_strings(job: Job) -> list[str]:
    """The `--set` strings that make this layout of the job."""
    g, t, c = job.grid, job.train, job.comm
    return [
        f"grid.pp={g.pp}",
        f"grid.dp={g.dp}",
        f"grid.order={g.order}",
        f"train.schedule={t.schedule}",
        f"train.virtual_stages={t.virtual_stages}",
        f"train.microbatches={t.microbatches}",
        f"comm.codec={c.codec}",
        f"comm.bucket_kb={c.bucket_kb}",
        f"comm.ring={c.ring}",
        f"comm.p2p_codec={c.p2p_codec}",
    ]


def _parts(r: dict) -> dict[str, float]:
    """The step of one prediction split into where its time goes (the slowest rank's)."""
    rank = max(r["ranks"], key=lambda x: x["end_s"])
    return {
        "compute": r["pipeline_s"] * (1 - r["bubble"]),
        "bubble": r["pipeline_s"] * r["bubble"],
        "ring on the core": rank["delay_s"],  # bucket work that delays the compute
        "exposed ring": rank["exposed_ring_s"],
        "rest": r["step_time_s"] - r["pipeline_s"] - rank["delay_s"] - rank["exposed_ring_s"],
    }


def _reason(entry: dict, best: dict | None, memory_bytes: float) -> str:
    """Why a layout wins or loses: the part of its step furthest above the best's."""
    r = entry["prediction"]
    parts = _parts(r)
    used = r["peak_memory_bytes"] / memory_bytes if memory_bytes else 0.0
    memory = f"; memory {100 * used:.0f}% of the device" if used > 0.85 else ""
    if best is None:
        ms = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in parts.items() if v > 5e-5)
        return f"best: {ms}{memory}"
    theirs = _parts(best["prediction"])
    worse = {k: parts[k] - theirs[k] for k in parts}
    key = max(worse, key=worse.get)
    if worse[key] <= 0:
        return f"within {100 * (1 - entry['throughput'] / best['throughput']):.1f}% of the best"
    j = r["job"]
    why = {
        "compute": "compute",
        "bubble": f"bubble {r['bubble']:.2f} vs {best['prediction']['bubble']:.2f}",
        "ring on the core": f"codec/ring work on the core ({j['codec']})",
        "exposed ring": f"link: ring exposed ({j['codec']}, {j['order']})",
        "rest": "per-step work (optimizer, batch)",
    }[key]
    return f"{why}: +{1e3 * worse[key]:.1f} ms{memory}"


def _entry(r: dict, candidate: Job) -> dict:
    return {
        "throughput": r["throughput"],
        "step_time_s": r["step_time_s"],
        "bubble": r["bubble"],
        "exposed_comm_s": r["exposed_comm_s"],
        "peak_memory_bytes": r["peak_memory_bytes"],
        "set": set_strings(candidate),
        "prediction": r,
    }


def search(job: Job, cluster: Cluster, world: int) -> tuple[list[dict], int]:
    """(every layout of `job` on `world` ranks that fits `cluster`, best throughput first; how
    many layouts were predicted). Each: {"throughput", "step_time_s", "bubble",
    "exposed_comm_s", "peak_memory_bytes", "set", "reason", "prediction"}. SearchError when no
    layout can be made; an empty list when none fits."""
    made, fitting, seen = 0, [], set()
    for layout in _pipelines(job, world):
        try:
            base = resolve(_replace(job, **layout), world)
        except (ConfigError, ScheduleError, ValueError):
            continue  # training would refuse this layout too
        if tuple(set_strings(base)) in seen:
            continue  # the same layout (a V schedule sets its own 2 chunks)
        seen.add(tuple(set_strings(base)))
        for wire in _wires(base, cluster):
            wired = _replace(base, comm={"p2p_codec": wire})
            try:
                piped = pipeline(wired, cluster)  # the wire's codec changes the messages
            except (ConfigError, ScheduleError, ValueError):
                break
            for comm in _comms(job, wired, cluster):
                candidate = _replace(wired, comm=comm) if comm else wired
                r = predict(candidate, cluster, piped)
                made += 1
                if all(m["fits"] for m in r["memory"]):
                    fitting.append(_entry(r, candidate))
    if not made:
        raise SearchError(
            f"no layout of this job on {world} ranks: every pp x dp, schedule "
            "and M was refused (see `mpihybrid train` for the rule)"
        )
    fitting.sort(key=lambda e: -e["throughput"])
    for i, entry in enumerate(fitting):
        entry["reason"] = _reason(entry, fitting[0] if i else None, cluster.node.memory_bytes)
    return fitting, made
