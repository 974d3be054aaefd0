"""What rank 0 says: the step line every train.log_every steps and the end-of-run report it
prints after `mpihybrid train`."""

from __future__ import annotations

import logging
import math

from mpi4py import MPI

from mpihybrid.config import Job
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.model import block_costs, build_blocks
from mpihybrid.nn.optim import learning_rate
from mpihybrid.trace.recorder import Recorder
from mpihybrid.train.memory import peak_rss_bytes
from mpihybrid.units import human_bytes

log = logging.getLogger("mpihybrid")


def log_step(
    job: Job, world: MPI.Comm, record, step: int, *, held_out_s: float, peak_flops: float | None
) -> None:
    """Collective: rank 0's step line, as torchtitan's metrics line: loss, accuracy, then over
    the steps since the last line: ms per step, throughput (tokens/s for token data), the share
    of the GEMM roofline (with peak_flops), every rank's peak memory, and the time left at that
    pace. record: train.summary.Record; held_out_s: the seconds held-out losses took so far
    (left out of the pace)."""
    peak = world.allreduce(peak_rss_bytes(), op=MPI.MAX)
    if world.rank != 0:
        return
    t = job.train
    first, since, evals = record.log_from
    now = Recorder.clock()
    record.log_from = (step + 1, now, held_out_s)
    steps = step + 1 - first
    per_step = (now - since - (held_out_s - evals)) / max(steps, 1)
    tokens = job.tokens_per_sample
    rows_per_s = t.global_batch * tokens / per_step if per_step > 0 else 0.0
    unit = "tokens/s" if tokens > 1 else "samples/s"
    parts = [
        f"step {step + 1}/{t.steps}",
        f"loss {record.losses[-1]:.4f}",
        f"acc {record.accuracies[-1]:.3f}",
        f"lr {learning_rate(t, step):.3g}",
        *([f"grad norm {record.grad_norm:.3g}"] if t.grad_clip else []),
        f"{1e3 * per_step:.1f} ms/step",
        f"{rows_per_s:,.0f} {unit}",
    ]
    if peak_flops:
        flops = sum(block_costs(build_blocks(job.model, *task_dims(job.data))))
        parts.append(f"roofline {100 * flops * rows_per_s / (world.size * peak_flops):.0f}%")
    parts.append(f"peak mem {human_bytes(peak)}")
    left = (t.steps - step - 1) * per_step
    if left > 0:
        parts.append(f"left {duration(left)}")
    log.info("%s", "  ".join(parts))


def duration(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def format_report(job: Job, summary) -> str:
    g, t, c = job.grid, job.train, job.comm
    v = f", v={t.virtual_stages}" if t.virtual_stages > 1 else ""
    rate = f"{summary.samples_per_s:,.0f} samples/s"
    if model_kind(job.model.kind).tokens:
        rate = f"{summary.samples_per_s * job.tokens_per_sample:,.0f} tokens/s"
    ran = summary.steps - summary.start  # a resumed run ran only the steps after its checkpoint
    lines = [
        "",
        f"== mpihybrid run: pp={g.pp} x dp={g.dp} ({g.order}), {t.schedule}{v}, "
        f"M={t.microbatches}, codec={c.codec}",
        f"runtime            {summary.runtime_s:.2f} s for {ran} steps ({rate})",
    ]
    if summary.start:
        lines.append(f"resumed            at step {summary.start} of {summary.steps}")
    if summary.losses:
        lines.append(
            f"final loss         {summary.losses[-1]:.4f} (first {summary.losses[0]:.4f}), "
            f"train acc {summary.accuracies[-1]:.3f}"
        )
    lines.append(f"held-out accuracy  {summary.test_accuracy:.4f}")
    if summary.evals:
        last, first = summary.evals[-1], summary.evals[0]
        per_byte = last["bits_per_byte"]
        per_byte = "" if math.isnan(per_byte) else f", {per_byte:.3f} bits/byte"
        lines.append(
            f"held-out loss      step {last['step']}: {last['loss']:.4f} nats, "
            f"{last['bits_per_token']:.3f} bits/token{per_byte}, perplexity "
            f"{last['perplexity']:.2f} (step {first['step']}: {first['loss']:.4f})"
        )
    sent = ", ".join(f"{k} {human_bytes(n)}" for k, n in sorted(summary.bytes_sent.items()))
    lines.append(f"bytes sent         {sent}")
    checks = ", ".join(f"stage {s}: {d:.3g}" for s, d in sorted(summary.replica_max_diff.items()))
    same = all(d == 0.0 for d in summary.replica_max_diff.values())
    verdict = "bit-identical" if same else "REPLICAS DIFFER"
    lines.append(f"replica check      max |w - w0| {checks}  -> {verdict}")
    peaks = ", ".join(f"stage {s}: {n}" for s, n in summary.peak_inflight.items())
    lines.append(f"peak activations   {peaks}")
    if summary.trace_path:
        lines.append(f"trace              {summary.trace_path}")
    lines += ["", f"as run (step {summary.steps}, replica 0):", summary.grid_as_run]
    return "\n".join(lines)
