"""Metrics from a trace: time split, bubble measured vs predicted, bytes, bandwidth, memory.

    mpihybrid analyze runs/seed.h5            # or: analyze(load("runs/seed.h5"))

Pure numpy on the event rows (no MPI). Times are seconds; a "phase" is one pipeline's compute
of one step: from the earliest F/B/W start to the latest F/B/W end among that replica's ranks.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mpihybrid.analysis.bandwidth import allreduce_bandwidth
from mpihybrid.analysis.costs import ran_lists, stage_costs, with_shares
from mpihybrid.analysis.messages import Messages, match_messages, message_latency
from mpihybrid.analysis.oversubscription import oversubscription
from mpihybrid.analysis.rows import durations, group_max, group_min, group_sum, groups
from mpihybrid.nn.kinds import KINDS as KINDS_OF_MODEL
from mpihybrid.pipeline.liveness import replay_rows
from mpihybrid.pipeline.plan import Schedule, trace_schedule
from mpihybrid.trace.read import Trace
from mpihybrid.trace.recorder import COMPUTE, KIND, KINDS, VOCAB_PASSES, step_times

# the columns of the time split, in table order; "recv" is time blocked waiting for a message
SPLIT = ("forward", "backward", "weight", "recv", "send", "allreduce", "optimizer")
# what the main thread does; with exposed_comm (its wait for the gradient buckets) and idle
# these add up to the step, while allreduce and optimizer may run behind them (comm.overlap)
MAIN_THREAD = ("forward", "backward", "weight", "recv", "send")


def _measured_steps(events: np.ndarray, skip_steps: int) -> np.ndarray:
    """The measured window: the steps after the first `skip_steps` (warm-up: the first step
    also compiles kernels and touches every buffer); all of them when nothing would be left."""
    steps = np.unique(events["step"][events["step"] >= 0])
    kept = steps[steps >= skip_steps]
    return kept if len(kept) else steps


# ---------------------------------------------------------------------------------------------
# the bubble


def bubble_summary(events: np.ndarray, schedule: Schedule, *, skip_steps: int = 1) -> dict:
    """Idle fraction of the pipeline phase, measured from the events and predicted by simulate().

    measured: per step and replica, the phase spans the earliest F/B/W start to the latest F/B/W
    end over that replica's ranks; a rank's idle = phase - its F+B+W time. The mean of idle/phase
    over ranks and steps (the first `skip_steps` are warm-up and left out while later ones exist).
    predicted: simulate() of the schedule as the run executed it (its value: pipeline.plan, as
    the run or the trace made it; its lists send gradients early where the run did), once per
    phase with that phase's own costs (stage_costs: each stage's mean F, B, W and whole B, the
    extra time of its last weight-gradient action, a rank's gap between actions) and the window's
    mean message latency (message_latency) on every cross-rank dependency; the mean over phases, as
    the measured fractions are averaged (one simulation of costs averaged over steps idles less
    than the steps did when some steps are slower than others). Both sides count the same
    thing: time inside a phase that is not F/B/W work on a rank.
    Returns {"measured", "predicted", "per_rank": {rank: measured}, "costs" (the window's
    means), "steps"}.
    """
    from mpihybrid.pipeline.simulate import Costs, simulate

    working = list(COMPUTE) + [KIND[k] for k in VOCAB_PASSES]
    compute = with_shares(events)  # vocab_parallel: an F or B's wait for the shares is idle
    compute = compute[np.isin(compute["kind"], working)]
    steps = _measured_steps(compute, skip_steps)
    compute = compute[np.isin(compute["step"], steps)]
    # one phase per (step, replica); one busy time per (phase, rank): grouped once, not masked
    phases, phase_of = groups(compute["step"], compute["replica"])
    phase = group_max(phase_of, compute["end"], len(phases)) - group_min(
        phase_of, compute["start"], len(phases)
    )
    cells, cell_of = groups(phase_of, compute["rank"])
    busy = group_sum(cell_of, durations(compute), len(cells))
    span = phase[cells[:, 0]] if len(cells) else np.zeros(0)
    kept = span > 0
    fraction = np.maximum(0.0, 1.0 - busy[kept] / span[kept])
    ranks, rank_of = np.unique(cells[kept, 1], return_inverse=True)
    means = np.bincount(rank_of, weights=fraction) / np.maximum(np.bincount(rank_of), 1)
    per_rank = {int(r): float(f) for r, f in zip(ranks, means, strict=True)}
    measured = float(fraction.mean()) if len(fraction) else 0.0

    actions, placement = schedule.lists(), schedule.placement
    num_stages = placement.num_stages
    send = message_latency(events[np.isin(events["step"], steps)], mean=True)
    costs = stage_costs(compute, num_stages, send) | {"send": send}
    # model.vocab_parallel: the lists as they ran (their passes were placed on timed costs)
    actions = ran_lists(compute) or actions
    order = np.argsort(phase_of, kind="stable")
    cut = np.flatnonzero(np.diff(phase_of[order])) + 1
    predicted = [
        simulate(actions, placement, Costs(**stage_costs(rows, num_stages, send), send=send))
        for rows in (np.split(compute[order], cut) if len(compute) else [])
    ]
    return {
        "measured": measured,
        "predicted": float(np.mean([sim.bubble_fraction for sim in predicted] or [0.0])),
        "per_rank": per_rank,
        "costs": costs,
        "steps": [int(s) for s in steps],
    }


# ---------------------------------------------------------------------------------------------
# the whole run


def flat_config(trace: Trace) -> dict[str, object]:
    """The job as {"section.key": value}; {} when the trace holds no readable job."""
    try:
        table = tomllib.loads(trace.config)
    except (tomllib.TOMLDecodeError, TypeError):
        return {}
    return {
        f"{section}.{key}": value
        for section, values in table.items()
        if isinstance(values, dict)
        for key, value in values.items()
    }


def _stage_param_counts(trace: Trace, num_stages: int) -> list[int] | None:
    """Parameters of every stage, counted from the job the trace stores (the all-reduce moves
    them as fp32), then (model.vocab_parallel) every vocabulary share's, the chunks the
    runtime numbers num_stages + pp rank; None when the trace holds no readable job."""
    from mpihybrid.config import ConfigError, build_job
    from mpihybrid.nn.data import task_dims
    from mpihybrid.nn.model import stage_num_params
    from mpihybrid.nn.vocab import share_layer

    try:
        table = tomllib.loads(trace.config)
        if not table:
            return None  # no job stored: the defaults would be a guess
        job = build_job(table)
        counts = stage_num_params(job.model, *task_dims(job.data), num_stages)
        if getattr(job.model, "vocab_parallel", False):
            d, pp = job.data, int(trace.attrs.get("pp", job.grid.pp))
            share = share_layer(job.model, d.seq_len, d.vocab, pp, 0, seed=0)
            counts += [share.cost(1, job.model.hidden).params] * pp
        return counts
    except (tomllib.TOMLDecodeError, ConfigError, ValueError, TypeError):
        return None


def _peak_activations(events: np.ndarray, num_stages: int) -> tuple[list[int], list[int]]:
    """Most micro-batches alive at once per stage, and the most bytes they held, replaying each
    rank's rows in start order (liveness.replay_rows)."""
    peak_count, peak_bytes = [0] * num_stages, [0] * num_stages
    compute = events[np.isin(events["kind"], list(COMPUTE))]
    # a rank's steps follow each other and each frees what it holds, so one replay of all of a
    # rank's rows in start order gives every step's peaks (one call per rank, not per step)
    compute = compute[np.argsort(compute["rank"], kind="stable")]
    cut = np.flatnonzero(np.diff(compute["rank"])) + 1
    for rows in np.split(compute, cut) if len(compute) else []:
        live = replay_rows(rows)
        for s in range(num_stages):
            peak_count[s] = max(peak_count[s], live.peak_count[s])
            peak_bytes[s] = max(peak_bytes[s], live.peak_bytes[s])
    return peak_count, peak_bytes


def analyze(trace: Trace, skip_steps: int = 1) -> dict:
    """Everything `mpihybrid analyze` reports, as plain numbers (JSON-ready).

    One measured window for every figure: the traced steps after the first `skip_steps`
    (warm-up), all of them when no other is traced ("window"). Times are seconds summed over the
    window (stage rows: over all replicas of the stage); step time, throughput, bubble, costs,
    all-reduce bandwidth and activations come from the window too. Bytes and event counts are
    totals over every traced step ("traced_steps"). Linear in the events (grouped, not masked).
    """
    from mpihybrid.pipeline.simulate import bubble_formula, bubble_text

    ev, attrs = trace.events, trace.attrs
    config = flat_config(trace)
    run = _run_info(attrs, config)
    run["finished"] = bool(attrs.get("finished", True))
    run["stopped_at_step"] = attrs.get("stopped_at_step")
    run["oversubscribed"] = oversubscription(attrs)
    if not trace.has_actions:
        return _steps_only(trace, run, config, skip_steps)
    pp, dp, m = run["pp"], run["dp"], run["microbatches"]
    schedule = trace_schedule(attrs)  # a csv: schedule from the trace's copy of its CSV
    v = run["virtual_stages"]
    num_stages = pp * v
    all_steps = ev[ev["kind"] == KIND["step"]]
    steps = _measured_steps(all_steps, skip_steps)
    window = ev[np.isin(ev["step"], steps)]
    of = {name: window[window["kind"] == KIND[name]] for name in KINDS}

    ranks = _rank_rows(window)
    bubble = bubble_summary(ev, schedule, skip_steps=skip_steps)
    bubble["formula"] = bubble_formula(schedule.spec, pp, m, v)
    bubble["formula_text"] = bubble_text(schedule.spec)
    for row in ranks:
        row["bubble"] = bubble["per_rank"].get(row["rank"])

    messages = match_messages(ev)
    allreduce = []
    if dp > 1:  # with one replica nothing travels
        params = _stage_param_counts(trace, num_stages)
        sharded = bool(config.get("train.shard_optimizer", False))
        allreduce = allreduce_bandwidth(of["allreduce"], params, dp, sharded)

    step_time = _step_time(all_steps, steps)
    run["world_size"] = int(attrs.get("world_size", len(ranks)))
    run["steps"] = len(step_time["per_step"])
    run["search"] = _search_info(attrs)
    sends = ev[ev["kind"] == KIND["send"]]
    return {
        "events": "all",
        "run": run,
        "window": _window(steps, step_time),
        "counts": {name: int(np.sum(ev["kind"] == KIND[name])) for name in KINDS},
        "ranks": ranks,
        "stages": _stage_rows(window, of, bubble["costs"], schedule=schedule),
        "bubble": bubble,
        "bytes": _bytes_sent(ev, sends, ev[ev["kind"] == KIND["allreduce"]], messages),
        "messages": {"sends": int(np.sum(sends["microbatch"] >= 0)), "matched": len(messages)},
        "allreduce": allreduce,
        "step_time": step_time,
        "throughput": _throughput(step_time, config, len(steps)),
        "straggler": _straggler(ranks),
        "quality": _quality(trace),
    }


def _window(steps: np.ndarray, step_time: dict) -> dict:
    """The measured window, in steps counted from 1 as the progress line counts them."""
    first, last = (int(steps[0]) + 1, int(steps[-1]) + 1) if len(steps) else (0, 0)
    traced = step_time["steps"]
    return {
        "first": first,
        "last": last,
        "steps": int(len(steps)),
        "traced_steps": len(traced),
        "left_out": [s for s in traced if s < first],  # warm-up steps, from 1
    }


def _search_info(attrs: dict) -> dict | None:
    """A searched schedule's prediction (train.schedule = "auto": the schedule_search
    attribute): placement, how it was found, predicted pipeline phase and bubble (at the mean
    costs; "expected": over the calibration run's steps, cli/auto.py); else None."""
    import json

    text = attrs.get("schedule_search")
    if text is None:
        return None
    try:
        doc = json.loads(str(text))
    except ValueError:
        return None
    keys = ("placement", "found_by", "status", "makespan", "bubble", "step_bound", "expected")
    return {k: doc.get(k) for k in keys}


STEPS_ONLY = "steps only"  # analyze()["events"] of a trace.events = false run


def _steps_only(trace: Trace, run: dict, config: dict, skip_steps: int) -> dict:
    """What a trace with one row per rank and step (trace.events = false) can tell: step times,
    throughput, each rank's step time, quality. No time split, bubble, bytes or memory."""
    step_rows = trace.events[trace.events["kind"] == KIND["step"]]
    steps = _measured_steps(step_rows, skip_steps)
    step_time = _step_time(step_rows, steps)
    run["world_size"] = int(trace.attrs.get("world_size", len(np.unique(step_rows["rank"]))))
    run["steps"] = len(step_time["per_step"])
    measured = step_rows[np.isin(step_rows["step"], steps)]
    ranks, rank_of = np.unique(measured["rank"], return_inverse=True)
    seconds = group_sum(rank_of, durations(measured), len(ranks))
    return {
        "events": STEPS_ONLY,
        "run": run,
        "window": _window(steps, step_time),
        "counts": {name: int(np.sum(trace.events["kind"] == KIND[name])) for name in KINDS},
        "ranks": [{"rank": int(r), "step": float(t)} for r, t in zip(ranks, seconds, strict=True)],
        "step_time": step_time,
        "throughput": _throughput(step_time, config, len(steps)),
        "quality": _quality(trace),
    }


def _run_info(attrs: dict, config: dict) -> dict:
    """How the run was laid out, from the trace's attributes (the job as a fallback)."""
    return {
        "schedule": str(attrs["schedule"]),
        "pp": int(attrs["pp"]),
        "dp": int(attrs["dp"]),
        "microbatches": int(attrs["microbatches"]),
        "virtual_stages": int(attrs.get("virtual_stages", 1)),
        # traces from before the option: off
        "early_grad_send": bool(attrs.get("early_grad_send", False)),
        "merge_w": int(attrs.get("merge_w", 1)),  # W passes merged in groups of up to it
        "codec": attrs.get("codec", config.get("comm.codec")),
        # the pipeline wire (traces from before it: fp32) and the gradient ring across nodes
        "p2p_codec": str(attrs.get("p2p_codec", config.get("comm.p2p_codec", "fp32"))),
        "p2p_scope": str(config.get("comm.p2p_codec_scope", "inter-node")),
        "order": str(attrs.get("order", config.get("grid.order", "pipeline-inner"))),
        "ring": str(attrs.get("ring", config.get("comm.ring", "flat"))),
    }


def _exposed(grad_wait: float | None, row: dict) -> dict:
    """How much of a rank's gradient work (ring + optimizer) the step waited for.

    Traces with grad_wait rows ran the buckets behind the compute (comm.overlap): what the main
    thread waited after its pipeline is exposed, the rest of the bucket time was hidden. Older
    traces ran the all-reduce and the optimizer after the pipeline: all of it is exposed.
    """
    work = row["allreduce"] + row["optimizer"]
    exposed = grad_wait if grad_wait is not None else work
    return {
        "exposed_comm": exposed,
        "hidden_comm": max(0.0, work - exposed),
        "hidden_fraction": max(0.0, 1.0 - exposed / work) if work > 0 else 0.0,
    }


def _rank_rows(ev: np.ndarray) -> list[dict]:
    """Per rank: seconds in each SPLIT column, the whole steps, idle and busy."""
    ranks = []
    rank_ids, first_row, rank_of = np.unique(ev["rank"], return_index=True, return_inverse=True)
    n = len(rank_ids)
    seconds = group_sum(rank_of * len(KINDS) + ev["kind"], durations(ev), n * len(KINDS))
    seconds = seconds.reshape(n, len(KINDS))
    counts = np.bincount(rank_of * len(KINDS) + ev["kind"], minlength=n * len(KINDS))
    counts = counts.reshape(n, len(KINDS))
    on_stage = ev["stage"] >= 0
    pairs = np.unique(np.stack([rank_of[on_stage], ev["stage"][on_stage]], axis=1), axis=0)
    for i, rank in enumerate(rank_ids):
        row = {"rank": int(rank), "replica": int(ev["replica"][first_row[i]])}
        row["stages"] = [int(s) for s in pairs[pairs[:, 0] == i, 1]]
        for name in SPLIT:
            row[name] = float(seconds[i, KIND[name]])
        row["total"] = float(seconds[i, KIND["step"]])
        waited = counts[i, KIND["grad_wait"]] > 0
        row.update(_exposed(float(seconds[i, KIND["grad_wait"]]) if waited else None, row))
        row["vocab"] = float(sum(seconds[i, KIND[k]] for k in VOCAB_PASSES))  # vocab_parallel
        main_thread = sum(row[name] for name in MAIN_THREAD) + row["exposed_comm"] + row["vocab"]
        row["idle"] = max(0.0, row["total"] - main_thread)
        busy = row["forward"] + row["backward"] + row["weight"] + row["optimizer"]
        row["busy"] = busy + row["vocab"]
        ranks.append(row)
    return ranks


def _stage_rows(ev: np.ndarray, of: dict, costs: dict, *, schedule: Schedule) -> list[dict]:
    """Per stage: seconds in each SPLIT column, mean F/B/W, activations in flight measured and
    predicted by the schedule."""
    from mpihybrid.pipeline.simulate import peak_inflight

    num_stages = schedule.placement.num_stages
    peak_count, peak_bytes = _peak_activations(ev, num_stages)
    lists = ran_lists(ev) or schedule.lists()  # vocab_parallel: the lists as they ran
    predicted_peak = peak_inflight(lists, schedule.placement)
    per_stage = {}
    for name in SPLIT:
        rows = of[name][(of[name]["stage"] >= 0) & (of[name]["stage"] < num_stages)]
        per_stage[name] = group_sum(rows["stage"], durations(rows), num_stages)
    stages = []
    for s in range(num_stages):
        row = {"stage": s}
        for name in SPLIT:
            row[name] = float(per_stage[name][s])
        for name in ("forward", "backward", "weight"):
            row[f"mean_{name}"] = costs[name][s]
        row["peak_inflight"] = peak_count[s]
        row["predicted_peak_inflight"] = predicted_peak[s]
        row["peak_activation_bytes"] = peak_bytes[s]
        stages.append(row)
    return stages


def _bytes_sent(ev: np.ndarray, sends: np.ndarray, rings: np.ndarray, messages: Messages) -> dict:
    """Bytes over every traced step."""
    nbytes = ev["bytes"][messages.send]
    sent = {
        "activation": int(nbytes[messages.direction == "F"].sum()),
        "activation_grad": int(nbytes[messages.direction == "B"].sum()),
    }
    # a send whose receive is not in the trace (none in a complete run)
    sent["unmatched"] = int(sends["bytes"].sum()) - sum(sent.values())
    sent["allreduce"] = int(rings["bytes"].sum())
    return sent


def _step_time(step_rows: np.ndarray, measured_steps: np.ndarray) -> dict:
    per_step = step_times(step_rows)
    kept = set(measured_steps.tolist())
    measured = [t for step, t in per_step.items() if step in kept]
    return {
        "mean": float(np.mean(measured)) if measured else 0.0,
        "median": float(statistics.median(measured)) if measured else 0.0,
        "min": min(measured, default=0.0),
        "max": max(measured, default=0.0),
        "first": next(iter(per_step.values()), 0.0),
        "per_step": list(per_step.values()),
        "steps": [s + 1 for s in per_step],  # per_step's steps, from 1
        "measured_seconds": float(sum(measured)),
    }


def _throughput(step_time: dict, config: dict, num_steps: int) -> dict:
    """Samples (and tokens, for token data) per second of the measured window: its batches over
    the sum of its step times, so that samples/s = global batch / mean step time."""
    seconds = step_time["measured_seconds"]
    global_batch = config.get("train.global_batch")
    samples = int(global_batch) * num_steps if global_batch is not None else None
    per_s = samples / seconds if samples is not None and seconds > 0 else None
    kind = KINDS_OF_MODEL.get(config.get("model.kind"))
    seq_len = config.get("data.seq_len") if kind is not None and kind.tokens else None
    return {
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": per_s,
        "tokens": samples * int(seq_len) if seq_len and samples is not None else None,
        "tokens_per_s": per_s * int(seq_len) if seq_len and per_s is not None else None,
    }


def _straggler(ranks: list[dict]) -> dict | None:
    if not ranks:
        return None
    straggler = max(ranks, key=lambda r: r["busy"])
    mean_busy = float(np.mean([r["busy"] for r in ranks]))
    return {
        "rank": straggler["rank"],
        "busy": straggler["busy"],
        "vs_mean": straggler["busy"] / mean_busy if mean_busy > 0 else 1.0,
    }


def _quality(trace: Trace) -> dict:
    loss, accuracy = trace.steps.get("loss"), trace.steps.get("accuracy")
    return {
        "final_loss": float(loss[-1]) if loss is not None and len(loss) else None,
        "train_accuracy": float(accuracy[-1]) if accuracy is not None and len(accuracy) else None,
        "test_accuracy": trace.attrs.get("test_accuracy"),
        "heldout": heldout_rows(trace),
        "grad_norm": _norms(trace.steps.get("grad_norm")),
    }


def _norms(values) -> dict | None:
    """train.grad_clip's global gradient norms: the last, the median and the largest."""
    if values is None or not len(values):
        return None
    v = np.asarray(values, np.float64)
    return {
        "last": float(v[-1]),
        "median": float(np.median(v)),
        "max": float(np.max(v)),
        "max_step": int(np.argmax(v)) + 1,
    }


def heldout_rows(trace: Trace) -> list[dict]:
    """The trace's held-out evaluations (/eval), steps from 1; bits_per_byte None unless a
    token is a byte."""
    rows = []
    for i, step in enumerate(trace.evals.get("step", [])):
        row = {"step": int(step) + 1}
        for name in ("loss", "bits_per_token", "bits_per_byte", "perplexity"):
            value = float(trace.evals[name][i])
            row[name] = None if math.isnan(value) else value
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# text
