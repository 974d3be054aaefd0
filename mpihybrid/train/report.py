"""The end-of-run report rank 0 prints after `mpihybrid train`."""

from __future__ import annotations

import math

from mpihybrid.config import Job
from mpihybrid.nn.kinds import model_kind
from mpihybrid.units import human_bytes


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
