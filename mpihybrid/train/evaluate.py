"""The model on samples it does not train on: the held-out loss every train.eval_every steps
and the held-out accuracy at the end, every replica's pipeline running its share. Both run the
stages forward only, in pieces sized by memory (eval_pieces), and are collective.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from mpi4py import MPI

from mpihybrid.config import Job
from mpihybrid.nn.data import heldout
from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.model import boundary_shapes
from mpihybrid.pipeline.runtime import forward_only
from mpihybrid.trace.recorder import Recorder

log = logging.getLogger("mpihybrid")

EVAL_LOGITS = 1 << 22  # logits held at once by the evaluation (16 MiB of float32)
EVAL_BYTES = 1 << 25  # activations a piece holds on its widest stage (32 MiB)


def eval_pieces(job: Job, rows: int, classes: int, tokens: int) -> int:
    """Rows forward at once in an evaluation: as many as keep the widest stage's activations
    within EVAL_BYTES (what a forward keeps per sample, nn.cost's count) and the logits within
    EVAL_LOGITS. Pieces of a training micro-batch made the final evaluation of a wide MLP 15 %
    slower (thousands of small GEMMs and messages); one whole piece once made the next stage
    wait 3 s on it without a tick of its watchdog. A piece this size is a fraction of a second
    of a stage's forward, and every piece ticks it (pipeline.runtime.forward_only)."""
    from mpihybrid.nn.cost import stage_work

    per_sample = max(c.activation_bytes for c in stage_work(job.workload)) / job.microbatch_size
    fits = int(EVAL_BYTES // max(per_sample, 1.0))
    return max(1, min(fits, EVAL_LOGITS // max(tokens * classes, 1), rows))


def heldout_accuracy(world: MPI.Comm, job: Job, run) -> float:
    """Held-out accuracy (gpt: of every next token): every replica's pipeline runs its share of
    the test set forward in pieces (eval_pieces); the same number on every rank.
    run: train.build.Run."""
    grid, task, backend = run.grid, run.task, run.backend
    placement = run.runtime.placement
    num_stages = placement.num_stages
    n, dp, r = len(task.test_x), grid.dp_size, grid.dp_rank
    lo, hi = n * r // dp, n * (r + 1) // dp
    rows = eval_pieces(job, hi - lo, task.num_classes, task.test_y[0].size)
    correct = 0
    for i in range(lo, hi, rows):
        x, y = task.test_x[i : min(i + rows, hi)], task.test_y[i : min(i + rows, hi)]
        shapes = boundary_shapes(job.model, task.in_features, task.num_classes, num_stages, len(x))
        x = x if backend.xp is np else backend.asarray(x)
        logits = forward_only(
            grid.pp_comm, run.stages, placement, x, shapes, backend=backend, vocab=run.runtime.vocab
        )
        if logits is not None:
            predicted = backend.to_host(logits.argmax(axis=-1))
            correct += int(np.count_nonzero(predicted == y))
    return world.allreduce(correct, op=MPI.SUM) / task.test_y.size


class HeldOutLoss:
    """The held-out losses of a run: its replica's samples (read at the first evaluation), the
    losses so far ({"step" (from 1), "loss" (nats per token), "bits_per_token", "bits_per_byte"
    (nan unless a token is a byte), "perplexity"}), the seconds they took (left out of the
    run's pace)."""

    def __init__(self) -> None:
        self.samples: tuple | None = None
        self.evals: list[dict] = []
        self.seconds = 0.0

    def due(self, job: Job, step: int) -> bool:
        t = job.train
        return bool(t.eval_every) and ((step + 1) % t.eval_every == 0 or step == t.steps - 1)

    def after_step(self, job: Job, world: MPI.Comm, run, step: int, quiet: bool) -> None:
        """Collective: the held-out loss after `step`, into the log, the trace and the Summary."""
        t0 = Recorder.clock()
        metrics = self.measure(job, world, run)
        self.seconds += Recorder.clock() - t0
        self.evals.append({"step": step + 1, **metrics})
        run.trace.add_eval(step, metrics)
        if not quiet and world.rank == 0:
            per_byte = metrics["bits_per_byte"]
            log.info(
                "eval %d/%d  val loss %.4f nats  %.3f bits/token%s  perplexity %.2f",
                step + 1,
                job.train.steps,
                metrics["loss"],
                metrics["bits_per_token"],
                "" if math.isnan(per_byte) else f"  {per_byte:.3f} bits/byte",
                metrics["perplexity"],
            )

    def measure(self, job: Job, world: MPI.Comm, run) -> dict[str, float]:
        """Collective: mean cross-entropy of the model on train.eval_batches global batches of
        held-out samples (the same ones every time), every replica's pipeline running its share;
        the same numbers on every rank."""
        g, t, task, backend = job.grid, job.train, run.task, run.backend
        placement = run.runtime.placement
        if self.samples is None:
            x, y = heldout(task, t.eval_batches * t.global_batch)
            mine = np.array_split(np.arange(len(x)), g.dp)[run.grid.dp_rank]
            self.samples = (x[mine], y[mine])
        x, y = self.samples
        rows = eval_pieces(job, len(x), task.num_classes, max(y[:1].size, 1))
        nats, targets = 0.0, 0
        loss_fn = model_kind(job.model.kind).loss()  # the last stage's, as in training
        for i in range(0, len(x), rows):
            shapes = boundary_shapes(
                job.model,
                task.in_features,
                task.num_classes,
                placement.num_stages,
                len(x[i : i + rows]),
            )
            piece = x[i : i + rows] if backend.xp is np else backend.asarray(x[i : i + rows])
            logits = forward_only(
                run.grid.pp_comm,
                run.stages,
                placement,
                piece,
                shapes,
                backend=backend,
                vocab=run.runtime.vocab,
            )
            if logits is not None:
                nats += loss_fn.nats(backend.to_host(logits), y[i : i + rows])
                targets += y[i : i + rows].size
        nats, targets = world.allreduce(np.array([nats, targets], np.float64), op=MPI.SUM)
        loss = float(nats / max(targets, 1))
        per_token = loss / math.log(2)
        per_byte = getattr(task, "bytes_per_token", None)
        return {
            "loss": loss,
            "bits_per_token": per_token,
            "bits_per_byte": per_token / per_byte if per_byte else math.nan,
            "perplexity": math.exp(min(loss, 700.0)),
        }
