"""The rules a job must keep, checked once it is resolved (dp known): names from fixed lists,
ranges, finiteness, the batch's divisibility, the model kind's and the data's own rules, the
schedule and the split of the model into chunks. Each error is one line with its numbers."""

from __future__ import annotations

import math
from dataclasses import fields

from mpihybrid.comm.buckets import RINGS
from mpihybrid.comm.codecs import CODECS
from mpihybrid.comm.device import DEVICES
from mpihybrid.comm.settings import PROGRESS
from mpihybrid.config.job import (
    AUTO,
    DECAY_ON,
    GRID_ORDERS,
    OPTIMIZERS,
    PARAM_CODECS,
    RECOMPUTE,
    SECTIONS,
    WARM,
    ConfigError,
    Job,
    ModelConfig,
)
from mpihybrid.nn.kinds import KINDS, kinds_with, model_kind
from mpihybrid.nn.optim import check_settings
from mpihybrid.pipeline.schedules import ScheduleError, check_config
from mpihybrid.pipeline.slowdown import Slowdown
from mpihybrid.pipeline.wire import P2P_CODECS, P2P_SCOPES
from mpihybrid.progress import TICK_S


def _one_of(where: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{where} = {value!r}: unknown; choose one of {', '.join(allowed)}")


def _check_names(job: Job) -> None:
    """Every setting that names one of a fixed list (schedules, codecs, devices, ...)."""
    g, m, d, t, c = job.grid, job.model, job.data, job.train, job.comm
    _one_of("grid.order", g.order, GRID_ORDERS)
    _one_of("grid.device", g.device, DEVICES)
    if c.cuda_aware != "auto" and not isinstance(c.cuda_aware, bool):
        raise ConfigError(f"comm.cuda_aware = {c.cuda_aware!r}: choose auto, true or false")
    _one_of("model.kind", m.kind, tuple(KINDS))
    if wrong := KINDS[m.kind].settings_problem(m):  # its own keys, no other kind's (nn/kinds.py)
        raise ConfigError(wrong)
    _one_of("data.kind", d.kind, KINDS[m.kind].data_kinds)
    try:
        if t.schedule != AUTO:
            _ = job.schedule_spec  # a registered name, csv:PATH of a readable CSV, or searched
    except ScheduleError as exc:
        raise ConfigError(f"train.schedule = {t.schedule!r}: {exc}") from None
    _one_of("train.optimizer", t.optimizer, OPTIMIZERS)
    _one_of("train.weight_decay_on", t.weight_decay_on, DECAY_ON)
    _one_of("comm.codec", c.codec, CODECS)
    _one_of("comm.overlap", c.overlap, PROGRESS)
    _one_of("comm.p2p_codec", c.p2p_codec, P2P_CODECS)
    _one_of("comm.p2p_codec_scope", c.p2p_codec_scope, P2P_SCOPES)
    _one_of("comm.ring", c.ring, RINGS)
    _one_of("train.recompute", t.recompute, RECOMPUTE)
    try:
        slow = Slowdown.parse(t.slowdown)
    except ValueError as exc:
        raise ConfigError(f"train.slowdown = {exc}") from None
    if slow is not None and slow.rank >= job.grid.pp * job.grid.dp:
        raise ConfigError(f"train.slowdown = {t.slowdown!r}: no rank {slow.rank} in this job")
    if c.param_codec:
        _one_of("comm.param_codec", c.param_codec, PARAM_CODECS)
        if not t.shard_optimizer:
            raise ConfigError(
                f"comm.param_codec = {c.param_codec!r} needs train.shard_optimizer = true "
                "(without it every replica updates all its weights: none are gathered)"
            )


def validate(job: Job) -> None:
    """Every rule that needs only the job; raises ConfigError with the rule and its numbers."""
    g, m, d, t = job.grid, job.model, job.data, job.train
    _check_names(job)
    _check_ranges(job)
    _check_finite(job)
    if t.lr <= 0:
        raise ConfigError(f"train.lr = {t.lr}: must be > 0")
    try:
        check_settings(t)  # the optimizer's ranges, the rate's schedule
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    per_step = g.dp * t.microbatches
    if t.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch({t.global_batch}) is not divisible by "
            f"dp({g.dp}) * microbatches({t.microbatches}) = {per_step}"
        )
    if wrong := vocab_parallel_problem(job):
        raise ConfigError(wrong)
    # the rules its kind's settings obey together (nn/kinds.py), a file to start from
    if wrong := KINDS[m.kind].check(m) or (m.init and _init_problem(m, d.seq_len, d.vocab)):
        raise ConfigError(wrong)
    _check_data(job)
    _check_schedule(job)


def _check_ranges(job: Job) -> None:
    """Every count's lower bound, and the settings that need another (a trace window's end, a
    checkpoint interval's directory, a timeout the watchdog can tell)."""
    m, d, t, c = job.model, job.data, job.train, job.comm
    for where, value, low in [
        ("model.hidden", m.hidden, 1),
        ("model.depth", m.depth, 1),
        ("data.vocab", d.vocab, 2),
        ("data.seq_len", d.seq_len, 1),
        ("data.branching", d.branching, 1),
        ("data.features", d.features, 1),
        ("data.train_samples", d.train_samples, 1),
        ("data.test_samples", d.test_samples, 1),
        ("train.steps", t.steps, 0),
        ("train.global_batch", t.global_batch, 1),
        ("train.microbatches", t.microbatches, 1),
        ("train.virtual_stages", t.virtual_stages, 1),
        ("train.merge_w", t.merge_w, 1),
        ("train.eval_every", t.eval_every, 0),
        ("train.lr_decay_steps", t.lr_decay_steps, 0),
        ("train.log_every", t.log_every, 0),
        ("train.eval_batches", t.eval_batches, 1),
        ("comm.block", c.block, 1),
        ("comm.bucket_kb", c.bucket_kb, 1),
        ("comm.segment_kb", c.segment_kb, 1),
        ("comm.timeout_s", c.timeout_s, 0),
        ("checkpoint.every", job.checkpoint.every, 0),
        ("trace.flush_steps", job.trace.flush_steps, 0),
        ("trace.flush_seconds", job.trace.flush_seconds, 0),
        ("trace.first_step", job.trace.first_step, 1),
        ("trace.last_step", job.trace.last_step, 0),
        ("trace.every", job.trace.every, 1),
        ("checkpoint.keep", job.checkpoint.keep, 1),
    ]:
        if value < low:
            raise ConfigError(f"{where} = {value}: must be >= {low}")
    if job.trace.last_step and job.trace.last_step < job.trace.first_step:
        raise ConfigError(
            f"trace.last_step({job.trace.last_step}) < trace.first_step({job.trace.first_step})"
            " (0 traces to the end)"
        )
    if 0 < c.timeout_s < TICK_S:  # 1e-6: milliseconds typed as seconds
        raise ConfigError(
            f"comm.timeout_s = {c.timeout_s:g}: below the watchdog's tick ({TICK_S:g} s), it would "
            "end a healthy run as stalled; it is in seconds (0 = never)"
        )
    if job.checkpoint.every and not job.checkpoint.dir:
        raise ConfigError(f"checkpoint.every = {job.checkpoint.every} needs checkpoint.dir")


def _check_data(job: Job) -> None:
    """The data kind's own rules: token files named, a vocabulary they can hold, a Markov
    chain's branching, a teacher's batch within its samples."""
    d, t = job.data, job.train
    if d.kind == "tokens":
        for where, value in (("data.train", d.train), ("data.val", d.val)):
            if not value:
                raise ConfigError(f'data.kind = "tokens" needs {where} (a token file or a glob)')
        if d.vocab > 65536:
            raise ConfigError(f"data.vocab = {d.vocab}: token files hold uint16, at most 65536")
    if d.kind == "markov" and d.branching > d.vocab:
        raise ConfigError(f"data.branching({d.branching}) > data.vocab({d.vocab})")
    if d.kind == "teacher" and t.global_batch > d.train_samples:
        raise ConfigError(
            f"train.global_batch({t.global_batch}) > data.train_samples({d.train_samples})"
        )


def _check_schedule(job: Job) -> None:
    """The schedule against the grid and micro-batches (a CSV's lists dry-run), and the model's
    split into pp * virtual_stages chunks."""
    g, m, t = job.grid, job.model, job.train
    if t.schedule == AUTO:
        _check_auto(job)
        return
    spec = job.schedule_spec
    try:
        check_config(spec, g.pp, t.microbatches, t.virtual_stages)
        if t.schedule.startswith("csv:"):  # its lists: every F/B/W once, no deadlock
            _ = job.schedule  # the value, made here once (Job.schedule)
    except ScheduleError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None  # the grid stays out
    try:
        _check_partition(m, g.pp, t.virtual_stages)
    except ConfigError as exc:
        if spec.chunks > 1:  # virtual_stages came from the schedule
            raise ConfigError(
                f"{exc} ({t.schedule} runs {t.virtual_stages} chunks per rank)"
            ) from None
        raise


NO_LIMIT = {("train", "schedule_inflight")}  # limits where inf reads as "no limit"


def _check_finite(job: Job) -> None:
    """No float setting may be nan or inf (TOML and --set both accept them), but a limit of
    NO_LIMIT may be inf."""
    for section in SECTIONS:
        part = getattr(job, section)
        for f in fields(part):
            value = getattr(part, f.name)
            values = value if isinstance(value, list) else [value]
            if (section, f.name) in NO_LIMIT and value == math.inf:
                continue
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ConfigError(f"{section}.{f.name} = {value!r}: must be a finite number")


PLACEMENTS = ("", "loop", "v")  # train.schedule_placement (config.searched.auto_placements)


def _check_auto(job: Job) -> None:
    """train.schedule = "auto": the search splits the blocks into pp (loop) or 2 pp (V) chunks."""
    m, g, t = job.model, job.grid, job.train
    if t.schedule_inflight and not t.schedule_inflight >= 1:  # NaN too; inf: no limit
        raise ConfigError(
            f"train.schedule_inflight = {t.schedule_inflight}: at least 1 "
            "micro-batch of a rank's share (0: pp)"
        )
    if t.schedule_calibrate < 0 or 0 < t.schedule_calibrate <= WARM:
        raise ConfigError(
            f"train.schedule_calibrate = {t.schedule_calibrate}: 0 (no calibration) or at least "
            f"{WARM + 1} steps (the first {WARM} are a warm-up)"
        )
    if not t.schedule_time >= 0:  # NaN too
        raise ConfigError(
            f"train.schedule_time = {t.schedule_time}: 0 (no exact search) or more of the exact "
            "search's deterministic seconds"
        )
    if t.schedule_placement not in PLACEMENTS:
        raise ConfigError(
            f"train.schedule_placement = {t.schedule_placement!r}: one of "
            + ", ".join(map(repr, PLACEMENTS))
            + " ('': both)"
        )
    if isinstance(m.partition, list) and t.schedule_placement:
        want = g.pp * (2 if t.schedule_placement == "v" else 1)
        if len(m.partition) != want:
            raise ConfigError(
                f"train.schedule_placement = {t.schedule_placement!r} with model.partition = "
                f"{m.partition}: a list of {want} counts"
            )
    if isinstance(m.partition, list):
        if len(m.partition) not in (g.pp, 2 * g.pp):
            raise ConfigError(
                f"train.schedule = 'auto' with model.partition = {m.partition}: a "
                f"list of pp ({g.pp}) or 2 pp counts (loop or V)"
            )
        _check_partition(m, g.pp, len(m.partition) // g.pp)
    else:
        _check_partition(m, g.pp, 1)


def _check_partition(m: ModelConfig, pp: int, virtual_stages: int) -> None:
    from mpihybrid.nn.model import check_counts

    chunks = pp * virtual_stages
    formula = f"pp({pp}) * virtual_stages({virtual_stages}) = {chunks}"
    ends = model_kind(m.kind).ends
    # cost partitions blocks (gpt: embedding and head are blocks too); the others split layers
    if ends and m.partition in ("cost", "timed"):
        blocks = m.depth + len(ends)
        if blocks < chunks:
            raise ConfigError(
                f"model.depth({m.depth}) + {len(ends)} ({', '.join(ends)}) = {blocks} blocks"
                f" < {formula}: every stage needs at least one block"
            )
    elif m.depth < chunks and not isinstance(m.partition, list):  # a list: check_counts says
        raise ConfigError(
            f"model.depth({m.depth}) < {formula}: every stage needs at least one layer"
        )
    if isinstance(m.partition, list):
        try:
            check_counts(m.partition, m.depth, chunks, ends_may_be_empty=bool(ends))
        except ValueError as exc:
            raise ConfigError(f"{exc} ({formula})") from None
    elif m.partition not in ("cost", "uniform", "timed"):
        raise ConfigError(
            f"model.partition = {m.partition!r}: use 'cost', 'uniform', 'timed' or a list of "
            "layer counts"
        )


def _init_problem(m: ModelConfig, seq_len: int, vocab: int) -> str:
    """model.init against the kind that would start from it (nn/kinds.py: ModelKind.weights)."""
    file = model_kind(m.kind).weights
    if file is None:
        return (
            f"model.init = {m.init!r}: starts {kinds_with('weights')} only (model.kind = "
            f"{m.kind!r} has no weights file)"
        )
    return file.check(m, seq_len, vocab)


def vocab_parallel_problem(job: Job) -> str:
    """model.vocab_parallel's rules (nn/vocab.py), in one line, or ""."""
    m = job.model
    if not m.vocab_parallel:
        return ""
    # a kind that splits no vocabulary has refused the key (ModelKind.settings_problem)
    if job.grid.pp < 2:
        return (
            f"model.vocab_parallel needs grid.pp >= 2 (pp = {job.grid.pp}: one rank holds the "
            "whole vocabulary anyway)"
        )
    return ""
