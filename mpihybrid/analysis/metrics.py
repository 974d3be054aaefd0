"""Metrics from a trace: time split, bubble measured vs predicted, bytes, bandwidth, memory.

    mpihybrid analyze runs/seed.h5            # or: analyze(load("runs/seed.h5"))

Pure numpy on the event rows (no MPI). Times are seconds; a "phase" is one pipeline's compute
of one step: from the earliest F/B/W start to the latest F/B/W end among that replica's ranks.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mpihybrid.pipeline.liveness import replay_rows
from mpihybrid.trace.file import Trace
from mpihybrid.trace.recorder import COMPUTE, KIND, KINDS, step_times

# the columns of the time split, in table order; "recv" is time blocked waiting for a message
SPLIT = ("forward", "backward", "weight", "recv", "send", "allreduce", "optimizer")
# what the main thread does; with exposed_comm (its wait for the gradient buckets) and idle
# these add up to the step, while allreduce and optimizer may run behind them (comm.overlap)
MAIN_THREAD = ("forward", "backward", "weight", "recv", "send")


def _durations(events: np.ndarray) -> np.ndarray:
    return events["end"] - events["start"]


def _measured_steps(events: np.ndarray, skip_steps: int) -> np.ndarray:
    """The steps after the first `skip_steps` (warm-up); all of them when nothing would be left."""
    steps = np.unique(events["step"][events["step"] >= 0])
    kept = steps[steps >= skip_steps]
    return kept if len(kept) else steps


# ---------------------------------------------------------------------------------------------
# point-to-point messages: which send fed which receive


@dataclass
class Messages:
    """Matched point-to-point messages, as row indices into the events they came from."""

    send: np.ndarray  # index of the send row
    recv: np.ndarray  # index of the matching recv row
    direction: np.ndarray  # "F" (activation) or "B" (activation gradient), per message
    producer_end: np.ndarray  # end of the F/B whose output the message carried
    consumer_start: np.ndarray  # start of the F/B that consumed it

    def __len__(self) -> int:
        return len(self.send)


def match_messages(events: np.ndarray) -> Messages:
    """Pair every send with its receive: same step, replica and micro-batch, the same direction,
    and the receiving stage is the sender's neighbour (s + 1 for an activation, s - 1 for a
    gradient), which names the peer: the one rank of the replica that owns that stage.

    Rows do not say which way a message went, and with interleaving one stage sends activations
    and gradients to the same peer, so the direction is read from the order on the rank: a SEND
    follows the F or B that produced its tensor, a RECV precedes the F or B that consumes it
    (schedules.lower).
    """
    col = {name: events[name].tolist() for name in ("rank", "step", "stage", "microbatch")}
    kind, start, end, replica = (events[n].tolist() for n in ("kind", "start", "end", "replica"))
    key = list(zip(col["rank"], col["step"], col["stage"], col["microbatch"], strict=True))
    compute: dict[tuple, dict[str, tuple[float, float]]] = {}  # (rank, step, stage, mb) -> F/B
    for i, k in enumerate(kind):
        if k in (KIND["forward"], KIND["backward"]):
            compute.setdefault(key[i], {})[COMPUTE[k]] = (start[i], end[i])

    recvs = {}  # (step, replica, stage, mb, direction) -> (row, start of the consumer)
    sends = []  # (row, direction, end of the producer)
    for i, k in enumerate(kind):
        if k not in (KIND["send"], KIND["recv"]) or key[i] not in compute:
            continue
        times = compute[key[i]]
        if k == KIND["recv"]:
            # the consumer: the first F/B of this (stage, mb) to start after the wait began
            after = [(t0, d) for d, (t0, _) in times.items() if t0 >= start[i]]
            if after:
                t0, d = min(after)
                recvs[(col["step"][i], replica[i], col["stage"][i], col["microbatch"][i], d)] = (
                    i, t0
                )  # fmt: skip
        else:
            # the producer: the last F/B of this (stage, mb) to end before the send began
            before = [(t1, d) for d, (_, t1) in times.items() if t1 <= start[i]]
            if before:
                t1, d = max(before)
                sends.append((i, d, t1))
    rows = []
    for i, d, t1 in sends:
        dest = col["stage"][i] + (1 if d == "F" else -1)
        hit = recvs.get((col["step"][i], replica[i], dest, col["microbatch"][i], d))
        if hit is not None:
            rows.append((i, hit[0], d, t1, hit[1]))
    return Messages(
        send=np.array([r[0] for r in rows], dtype=np.int64),
        recv=np.array([r[1] for r in rows], dtype=np.int64),
        direction=np.array([r[2] for r in rows], dtype="<U1"),
        producer_end=np.array([r[3] for r in rows], dtype=np.float64),
        consumer_start=np.array([r[4] for r in rows], dtype=np.float64),
    )


def message_latency(events: np.ndarray, messages: Messages | None = None) -> float:
    """Median seconds from the end of a producing F/B to the start of its consumer on another
    rank, over the messages whose receiver was already waiting (so the gap is the hop itself:
    send post, transfer, wake-up); 0.0 when no receiver ever waited."""
    messages = messages if messages is not None else match_messages(events)
    if not len(messages):
        return 0.0
    waited = events["start"][messages.recv] <= events["start"][messages.send]
    hops = (messages.consumer_start - messages.producer_end)[waited]
    return float(np.median(hops)) if len(hops) else 0.0


# ---------------------------------------------------------------------------------------------
# the bubble


def stage_costs(events: np.ndarray, num_stages: int) -> dict[str, list[float]]:
    """Mean seconds of one F, B and W per stage (0.0 where a stage has none of that kind)."""
    costs = {}
    for name in ("forward", "backward", "weight"):
        rows = events[events["kind"] == KIND[name]]
        means = [_durations(rows[rows["stage"] == s]) for s in range(num_stages)]
        costs[name] = [float(d.mean()) if len(d) else 0.0 for d in means]
    return costs


def bubble_summary(
    events: np.ndarray,
    schedule: str,
    pp: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    skip_steps: int = 1,
    early_grad_send: bool = False,
) -> dict:
    """Idle fraction of the pipeline phase, measured from the events and predicted by simulate().

    measured: per step and replica, the phase spans the earliest F/B/W start to the latest F/B/W
    end over that replica's ranks; a rank's idle = phase - its F+B+W time. The mean of idle/phase
    over ranks and steps (the first `skip_steps` are warm-up and left out while later ones exist).
    predicted: simulate() of the schedule as the run executed it (early_grad_send) with each
    stage's measured mean F, B, W and the measured message latency (message_latency) on every
    cross-rank dependency.
    Returns {"measured", "predicted", "per_rank": {rank: measured}, "costs", "steps"}.
    """
    from mpihybrid.pipeline.schedules import build_schedule
    from mpihybrid.pipeline.simulate import Costs, simulate

    compute = events[np.isin(events["kind"], list(COMPUTE))]
    steps = _measured_steps(compute, skip_steps)
    compute = compute[np.isin(compute["step"], steps)]
    fractions: dict[int, list[float]] = {}
    for step in steps:
        in_step = compute[compute["step"] == step]
        for replica in np.unique(in_step["replica"]):
            rows = in_step[in_step["replica"] == replica]
            phase = float(rows["end"].max() - rows["start"].min())
            if phase <= 0:
                continue
            for rank in np.unique(rows["rank"]):
                busy = float(_durations(rows[rows["rank"] == rank]).sum())
                fractions.setdefault(int(rank), []).append(max(0.0, 1.0 - busy / phase))
    per_rank = {r: float(np.mean(f)) for r, f in sorted(fractions.items())}
    everything = [f for fs in fractions.values() for f in fs]
    measured = float(np.mean(everything)) if everything else 0.0

    num_stages = pp * virtual_stages
    costs = stage_costs(compute, num_stages)
    costs["send"] = message_latency(events[np.isin(events["step"], steps)])
    actions = build_schedule(schedule, pp, num_microbatches, virtual_stages, early_grad_send)
    sim = simulate(actions, Costs(**costs), virtual_stages)
    return {
        "measured": measured,
        "predicted": float(sim.bubble_fraction),
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
    them as fp32); None when the trace holds no readable job."""
    from mpihybrid.config import ConfigError, build_job
    from mpihybrid.nn.data import task_dims
    from mpihybrid.nn.model import stage_num_params

    try:
        table = tomllib.loads(trace.config)
        if not table:
            return None  # no job stored: the defaults would be a guess
        job = build_job(table)
        return stage_num_params(job.model, *task_dims(job.data), num_stages)
    except (tomllib.TOMLDecodeError, ConfigError, ValueError, TypeError):
        return None


def _sum(rows: np.ndarray) -> float:
    return float(_durations(rows).sum())


def _peak_activations(events: np.ndarray, num_stages: int) -> tuple[list[int], list[int]]:
    """Most micro-batches alive at once per stage, and the most bytes they held, replaying each
    (rank, step) in start order (liveness.replay_rows)."""
    peak_count, peak_bytes = [0] * num_stages, [0] * num_stages
    compute = events[np.isin(events["kind"], list(COMPUTE))]
    for rank, step in {(int(e["rank"]), int(e["step"])) for e in compute}:
        live = replay_rows(compute[(compute["rank"] == rank) & (compute["step"] == step)])
        for s in range(num_stages):
            peak_count[s] = max(peak_count[s], live.peak_count[s])
            peak_bytes[s] = max(peak_bytes[s], live.peak_bytes[s])
    return peak_count, peak_bytes


def _allreduce_bandwidth(rows: np.ndarray, params: list[int] | None, n: int) -> list[dict]:
    """nccl-tests figures per stage: size = the fp32 gradient, algbw = size / time,
    busbw = algbw * 2(n-1)/n; time = the mean over steps of the sum over the stage's buckets
    (the microbatch column; -1 in traces from before buckets) of each ring's shortest duration.
    A bucket that overlapped compute shares the core with it: its bandwidth reads low."""
    out = []
    for s in np.unique(rows["stage"]):
        mine = rows[rows["stage"] == s]
        # a ring finishes together: the last rank to arrive waits least, so the shortest
        # duration of one call is the collective's own time (nccl-tests times after a barrier)
        per_step = []
        for t in np.unique(mine["step"]):
            of_step = mine[mine["step"] == t]
            buckets = np.unique(of_step["microbatch"])
            per_step.append(
                sum(_durations(of_step[of_step["microbatch"] == b]).min() for b in buckets)
            )
        seconds = float(np.mean(per_step))
        calls = len(np.unique(mine[["step", "rank"]]))  # one rank's reduction of one step
        size = 4 * params[s] if params is not None else None
        algbw = size / seconds if size is not None and seconds > 0 else None
        out.append(
            {
                "stage": int(s),
                "ranks": n,
                "size_bytes": size,
                "seconds": seconds,
                "algbw": algbw,
                "busbw": algbw * 2 * (n - 1) / n if algbw is not None else None,
                "wire_bytes": float(mine["bytes"].sum() / calls),  # one rank, one step
            }
        )
    return out


def analyze(trace: Trace, skip_steps: int = 1) -> dict:
    """Everything `mpihybrid analyze` reports, as plain numbers (JSON-ready).

    Times are seconds summed over the whole run (stage rows: over all replicas of the stage);
    step time, bubble, costs and all-reduce bandwidth leave out the first `skip_steps` steps.
    """
    from mpihybrid.pipeline.simulate import BUBBLE_FORMULAS, bubble_formula

    ev, attrs = trace.events, trace.attrs
    config = flat_config(trace)
    run = _run_info(attrs, config)
    run["finished"] = bool(attrs.get("finished", True))
    run["stopped_at_step"] = attrs.get("stopped_at_step")
    if not trace.has_actions:
        return _steps_only(trace, run, config, skip_steps)
    pp, dp, schedule, m = run["pp"], run["dp"], run["schedule"], run["microbatches"]
    v, early = run["virtual_stages"], run["early_grad_send"]
    num_stages = pp * v
    of = {name: ev[ev["kind"] == KIND[name]] for name in KINDS}
    steps = _measured_steps(of["step"], skip_steps)

    ranks = _rank_rows(ev)
    bubble = bubble_summary(ev, schedule, pp, m, v, skip_steps, early)
    bubble["formula"] = bubble_formula(schedule, pp, m, v)
    bubble["formula_text"] = BUBBLE_FORMULAS[schedule]
    for row in ranks:
        row["bubble"] = bubble["per_rank"].get(row["rank"])

    messages = match_messages(ev)
    allreduce = []
    if dp > 1:  # with one replica nothing travels
        rows = of["allreduce"][np.isin(of["allreduce"]["step"], steps)]
        allreduce = _allreduce_bandwidth(rows, _stage_param_counts(trace, num_stages), dp)

    step_time = _step_time(of["step"], steps)
    run["world_size"] = int(attrs.get("world_size", len(ranks)))
    run["steps"] = len(step_time["per_step"])
    return {
        "events": "all",
        "run": run,
        "counts": {name: int(len(of[name])) for name in KINDS},
        "ranks": ranks,
        "stages": _stage_rows(ev, of, bubble["costs"], schedule, pp, m, v, early),
        "bubble": bubble,
        "bytes": _bytes_sent(ev, of, messages),
        "messages": {
            "sends": int(np.sum(of["send"]["microbatch"] >= 0)),
            "matched": len(messages),
        },
        "allreduce": allreduce,
        "step_time": step_time,
        "throughput": _throughput(of["step"], config, run["steps"]),
        "straggler": _straggler(ranks),
        "quality": _quality(trace),
    }


STEPS_ONLY = "steps only"  # analyze()["events"] of a trace.events = false run


def _steps_only(trace: Trace, run: dict, config: dict, skip_steps: int) -> dict:
    """What a trace with one row per rank and step (trace.events = false) can tell: step times,
    throughput, each rank's step time, quality. No time split, bubble, bytes or memory."""
    step_rows = trace.events[trace.events["kind"] == KIND["step"]]
    step_time = _step_time(step_rows, _measured_steps(step_rows, skip_steps))
    run["world_size"] = int(trace.attrs.get("world_size", len(np.unique(step_rows["rank"]))))
    run["steps"] = len(step_time["per_step"])
    ranks = [
        {"rank": int(r), "step": _sum(step_rows[step_rows["rank"] == r])}
        for r in np.unique(step_rows["rank"])
    ]
    return {
        "events": STEPS_ONLY,
        "run": run,
        "counts": {name: int(np.sum(trace.events["kind"] == KIND[name])) for name in KINDS},
        "ranks": ranks,
        "step_time": step_time,
        "throughput": _throughput(step_rows, config, run["steps"]),
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
        "codec": attrs.get("codec", config.get("comm.codec")),
    }


def _exposed(mine: np.ndarray, row: dict) -> dict:
    """How much of a rank's gradient work (ring + optimizer) the step waited for.

    Traces with grad_wait rows ran the buckets behind the compute (comm.overlap): what the main
    thread waited after its pipeline is exposed, the rest of the bucket time was hidden. Older
    traces ran the all-reduce and the optimizer after the pipeline: all of it is exposed.
    """
    work = row["allreduce"] + row["optimizer"]
    wait = mine[mine["kind"] == KIND["grad_wait"]]
    exposed = _sum(wait) if len(wait) else work
    return {
        "exposed_comm": exposed,
        "hidden_comm": max(0.0, work - exposed),
        "hidden_fraction": max(0.0, 1.0 - exposed / work) if work > 0 else 0.0,
    }


def _rank_rows(ev: np.ndarray) -> list[dict]:
    """Per rank: seconds in each SPLIT column, the whole steps, idle and busy."""
    ranks = []
    for rank in np.unique(ev["rank"]):
        mine = ev[ev["rank"] == rank]
        row = {"rank": int(rank), "replica": int(mine["replica"][0])}
        row["stages"] = sorted({int(s) for s in mine["stage"] if s >= 0})
        for name in SPLIT:
            row[name] = _sum(mine[mine["kind"] == KIND[name]])
        row["total"] = _sum(mine[mine["kind"] == KIND["step"]])
        row.update(_exposed(mine, row))
        main_thread = sum(row[name] for name in MAIN_THREAD) + row["exposed_comm"]
        row["idle"] = max(0.0, row["total"] - main_thread)
        row["busy"] = row["forward"] + row["backward"] + row["weight"] + row["optimizer"]
        ranks.append(row)
    return ranks


def _stage_rows(
    ev: np.ndarray, of: dict, costs: dict, schedule: str, pp: int, m: int, v: int, early: bool
) -> list[dict]:
    """Per stage: seconds in each SPLIT column, mean F/B/W, activations in flight measured and
    predicted by the schedule."""
    from mpihybrid.pipeline.schedules import build_schedule
    from mpihybrid.pipeline.simulate import peak_inflight

    num_stages = pp * v
    peak_count, peak_bytes = _peak_activations(ev, num_stages)
    predicted_peak = peak_inflight(build_schedule(schedule, pp, m, v, early), num_stages)
    stages = []
    for s in range(num_stages):
        row = {"stage": s}
        for name in SPLIT:
            row[name] = _sum(of[name][of[name]["stage"] == s])
        for name in ("forward", "backward", "weight"):
            row[f"mean_{name}"] = costs[name][s]
        row["peak_inflight"] = peak_count[s]
        row["predicted_peak_inflight"] = predicted_peak[s]
        row["peak_activation_bytes"] = peak_bytes[s]
        stages.append(row)
    return stages


def _bytes_sent(ev: np.ndarray, of: dict, messages: Messages) -> dict:
    nbytes = ev["bytes"][messages.send]
    sent = {
        "activation": int(nbytes[messages.direction == "F"].sum()),
        "activation_grad": int(nbytes[messages.direction == "B"].sum()),
    }
    # a send whose receive is not in the trace (none in a complete run)
    sent["unmatched"] = int(of["send"]["bytes"].sum()) - sum(sent.values())
    sent["allreduce"] = int(of["allreduce"]["bytes"].sum())
    return sent


def _step_time(step_rows: np.ndarray, measured_steps: np.ndarray) -> dict:
    per_step = step_times(step_rows)
    measured = [t for step, t in per_step.items() if step in measured_steps]
    return {
        "mean": float(np.mean(measured)) if measured else 0.0,
        "median": float(statistics.median(measured)) if measured else 0.0,
        "min": min(measured, default=0.0),
        "max": max(measured, default=0.0),
        "first": next(iter(per_step.values()), 0.0),
        "per_step": list(per_step.values()),
    }


def _throughput(step_rows: np.ndarray, config: dict, num_steps: int) -> dict:
    span = float(step_rows["end"].max() - step_rows["start"].min()) if len(step_rows) else 0.0
    global_batch = config.get("train.global_batch")
    samples = int(global_batch) * num_steps if global_batch is not None else None
    return {
        "samples": samples,
        "seconds": span,
        "samples_per_s": samples / span if samples is not None and span > 0 else None,
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
