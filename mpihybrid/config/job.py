"""The job's settings: one frozen dataclass per section of a job file, each field documented,
and the names a setting may take. config/__init__.py builds a Job from TOML and `--set`;
config/rules.py checks it:

    job = Job(grid=GridConfig(pp=2, dp=2), train=TrainConfig(steps=20))
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, fields

import numpy as np

from mpihybrid.comm.codecs import get_codec
from mpihybrid.comm.device import CPU, Backend
from mpihybrid.comm.layout import ORDERS, Layout
from mpihybrid.comm.settings import GradientSettings, RingSettings
from mpihybrid.nn.cost import Workload
from mpihybrid.nn.kinds import DEFAULT_KIND, kind_settings, model_kind
from mpihybrid.pipeline.plan import Schedule, ScheduleError, make_schedule, spec_of
from mpihybrid.pipeline.slowdown import Slowdown
from mpihybrid.pipeline.spec import ScheduleSpec
from mpihybrid.pipeline.wire import P2PWire

AUTO = "auto"  # train.schedule searched for the job at the start (cli/auto.py)
# a calibration run's first steps left out (cli/auto.py): a fresh process's first step is
# 1.5x, its second 1.1x the later ones (gpt_bench, zb-h1: 398, 301, then 272-287 ms)
WARM = 2
OPTIMIZERS = ("sgd", "adamw")
DECAY_ON = ("matrices", "matrices+embeddings", "all")  # train.weight_decay_on
GRID_ORDERS = (*ORDERS, "auto")  # auto: the one predict ranks first (predict.auto)
PARAM_CODECS = ("fp32", "bf16", "int8")  # the weight all-gather of train.shard_optimizer
RECOMPUTE = ("none", "full")
# keys that take a value of more than one type: (section, key) -> the types allowed
UNION_KEYS = {("model", "partition"): (str, list), ("comm", "cuda_aware"): (str, bool)}


class ConfigError(ValueError):
    """A job that cannot run; the message is one line meant for the user."""


@dataclass(frozen=True)
class GridConfig:
    pp: int = 1  # pipeline stages per pipeline
    dp: int = -1  # data-parallel replicas per stage; -1 = world size // pp
    # pipeline-inner: rank = dp_rank*pp + pp_rank; data-inner: swapped; auto: the one predict
    # ranks first for the world and the nodes MPI reports (predict.auto)
    order: str = "pipeline-inner"
    device: str = "cpu"  # cpu (numpy) | cuda (CuPy, GPU local_rank % GPUs on the node)

    @property
    def layout(self) -> Layout:
        """Where each rank sits (a resolved grid: dp known)."""
        return Layout(self.pp, self.dp, self.order)


@dataclass(frozen=True)
class ModelSettings:
    """[model]'s keys that every kind reads; ModelConfig adds each kind's own (its module's
    settings, nn/settings.py), flat beside them: `model.heads`, not a sub-table."""

    kind: str = DEFAULT_KIND  # a registered kind (nn/kinds.py): what the model is
    hidden: int = 64  # the width of its layers (its kind's builder says which)
    depth: int = 6  # its layers between the ends (its kind's builder says which count)
    partition: str | list = "cost"  # cost | uniform | timed | [layers per chunk]
    init: str = ""  # start from this .safetensors file (weights export) instead of the seed


def model_config_class(kinds=None) -> type:
    """The [model] dataclass: ModelSettings' keys, then every registered kind's own (its
    default, its type), frozen like every section."""
    settings = kind_settings(kinds).values()
    own = [(s.name, type(s.default), field(default=s.default)) for s in settings]
    cls = dataclasses.make_dataclass("ModelConfig", own, bases=(ModelSettings,), frozen=True)
    cls.__module__ = __name__  # pickled (a job travels to every rank) by this module's name
    cls.__doc__ = "[model]: every kind's keys (ModelSettings) and each kind's own (nn/kinds.py)."
    return cls


ModelConfig = model_config_class()


@dataclass(frozen=True)
class DataConfig:
    kind: str = "teacher"  # teacher: X ~ N(0, 1), y = [X . w_true > 0] | random-tokens | markov
    features: int = 120  # teacher
    train_samples: int = 16384  # teacher: samples per epoch (token data never repeats)
    test_samples: int = 2048  # held-out samples (token data: sequences)
    seed: int = 1234  # draws the teacher and the samples
    vocab: int = 10000  # token data: vocabulary size
    seq_len: int = 64  # token data: tokens per sequence
    branching: int = 2  # markov: successors of every token (entropy rate ln(branching))
    train: str = ""  # tokens: llm.c-format token file or glob of shards (mpihybrid data prepare)
    val: str = ""  # tokens: held-out token file or glob (evaluation, the final accuracy)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = (
        96  # samples per step over all replicas; split into dp shards of M micro-batches
    )
    microbatches: int = 4  # M, per replica per step
    schedule: str = "1f1b"
    virtual_stages: int = 1  # model chunks per rank (interleaved-1f1b; a V schedule sets its 2)
    # schedule = "auto" (cli/auto.py): costs from this trace instead of timing the blocks,
    # the memory limit in micro-batches of a rank's share (0: pp, 1F1B's), the placements
    # searched ("": loop and V; "loop" or "v": that one alone), and the steps the first search's
    # schedule runs so its measured stage costs calibrate the timed blocks' (0 or >= 3)
    schedule_costs: str = ""
    schedule_inflight: float = 0.0
    schedule_placement: str = ""
    schedule_calibrate: int = 5  # steps the first search's schedule runs to calibrate (0: none)
    # the exact search's deterministic time limit (CP-SAT's, about seconds), over every split a
    # search solves (0: no exact search, the greedy and the built-ins alone)
    schedule_time: float = 4.0
    early_grad_send: bool = True  # a backward sends its input gradient before the weight gradient
    merge_w: int = 1  # a stage's W passes merged into one GEMM per weight, up to this many (1: off)
    optimizer: str = "sgd"
    lr: float = 0.01  # the peak rate (lr_schedule: the rate after the warmup)
    lr_schedule: str = "constant"  # constant | cosine | linear: decay to min_lr at the last step
    warmup_steps: int = 0  # linear warmup over this many first steps (nanoGPT's get_lr)
    min_lr: float = 0.0  # cosine, linear: the rate the decay ends at
    lr_decay_steps: int = 0  # cosine, linear: the step the decay ends at (0 = train.steps)
    grad_clip: float = 0.0  # clip the global gradient norm (all stages) to this; 0 = off
    momentum: float = 0.9  # sgd
    weight_decay: float = 0.0
    # what weight_decay decays: matrices (2-D weights: not biases, LayerNorm gains or the
    # embeddings; nanoGPT's and Megatron's rule) | matrices+embeddings | all (the rule before)
    weight_decay_on: str = "matrices"
    betas: list = field(default_factory=lambda: [0.9, 0.999])  # adamw
    seed: int = 0  # parameter initialisation
    eval_every: int = 0  # held-out loss every this many steps and after the last (0 = never)
    eval_batches: int = 4  # held-out loss over this many global batches of held-out samples
    log_every: int = 1  # rank 0's step line every this many steps and at the last (0 = none)
    # ZeRO-1: each replica keeps the optimizer state of its chunk of every bucket only,
    # updates that chunk and all-gathers the weights (in comm.param_codec)
    shard_optimizer: bool = False
    recompute: str = "none"  # none | full: keep only each micro-batch's input, redo its forward
    slowdown: str = ""  # "RANK:KINDS:FACTOR": a straggler on purpose (pipeline/slowdown.py)


@dataclass(frozen=True)
class CommConfig:
    codec: str = "fp32"  # gradient all-reduce: fp32 | fp16 | bf16 | int8
    block: int = 256  # int8: elements per absmax scale
    error_feedback: bool = True  # lossy codecs carry their quantisation error into the next step
    sync_sends: bool = False  # pipeline sends with Issend (proves no reliance on eager buffering)
    cuda_aware: str | bool = "auto"  # device = cuda: MPI takes GPU buffers; auto = ask the MPI
    # gradient buckets: how the rings make progress behind the compute (thread | poll | off)
    overlap: str = "poll"
    bucket_kb: int = 4096  # a bucket holds whole layers of at least this many KiB of gradient
    segment_kb: int = 2048  # the ring sends a chunk in messages of this many KiB of float32
    param_codec: str = ""  # train.shard_optimizer's weight all-gather: fp32 | bf16 | int8 ("" fp32)
    # pipeline links: activations and their gradients in fp32 | fp16 | bf16 | int8 (per-row scales)
    p2p_codec: str = "fp32"
    p2p_codec_scope: str = "inter-node"  # which links p2p_codec encodes: inter-node | all
    # a stage's gradient ring: flat | hierarchical (inside each node, then across, then inside);
    # auto: hierarchical where the stage's replicas span nodes
    ring: str = "auto"
    # a rank that makes no progress (no action ends, no message arrives) this long aborts the job,
    # saying what it waits on and writing its flight record; 0 = never
    timeout_s: float = 600.0


@dataclass(frozen=True)
class TraceConfig:
    path: str = ""  # HDF5 trace, written by rank 0 as the run goes; "" = none
    overwrite: bool = False  # replace an existing trace file
    events: bool = True  # record every action; false = only one row per step (overhead baseline)
    flush_steps: int = 100  # the trace file is brought up to date every this many steps (0 = off)
    flush_seconds: float = 30.0  # ... and at the first step boundary this long after (0 = off)
    first_step: int = 1  # trace steps first_step..last_step (1-based, as the progress line)
    last_step: int = 0  # 0 = to the end
    every: int = 1  # of those, every k-th step (first_step, first_step + k, ...)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = never (a preemption signal still writes one)
    dir: str = ""  # checkpoints live here; a run resumes from the newest complete one
    keep: int = 2  # complete checkpoints kept (older ones are deleted after a new one lands)


@dataclass(frozen=True)
class Searched:
    """A schedule the search found (train.schedule = "auto"): its name csv:auto@HASH, its CSV
    text, and the search's record (JSON), as config.searched.apply gives them to the job."""

    name: str
    csv: str
    record: str


@dataclass(frozen=True)
class Job:
    grid: GridConfig = field(default_factory=GridConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # not a section: a searched schedule's CSV and record (config.searched.apply), which no file
    # holds; the schedule value takes them while train.schedule names it
    searched: Searched | None = field(default=None, metadata={"section": False})

    @functools.cached_property
    def schedule(self) -> Schedule:
        """train.schedule as one value (pipeline/plan.py), made once for this job (a job made
        with other settings makes its own): placement, every rank's compute lists, a CSV's text,
        a searched schedule's record. ScheduleError where the settings make none (validate
        says so first, as a ConfigError)."""
        t, found = self.train, self._found()
        if t.schedule == AUTO:
            raise ScheduleError("train.schedule = 'auto' is searched before the run is built")
        return make_schedule(
            t.schedule,
            self.grid.pp,
            t.microbatches,
            t.virtual_stages,
            t.early_grad_send,
            csv=found.csv if found else None,
            search=found.record if found else None,
            merge_w=t.merge_w,
        )

    @property
    def schedule_spec(self) -> ScheduleSpec:
        """train.schedule's spec (a searched one's of its CSV): its chunks and rules, before
        any list is built. ScheduleError for an unknown name or an unreadable CSV."""
        found = self._found()
        return spec_of(self.train.schedule, found.csv if found else None)

    def _found(self) -> Searched | None:
        """The searched schedule while train.schedule names it."""
        found = self.searched
        return found if found is not None and found.name == self.train.schedule else None

    @property
    def microbatch_size(self) -> int:
        """Samples in one micro-batch: the global batch over dp replicas of M micro-batches."""
        return self.train.global_batch // (self.grid.dp * self.train.microbatches)

    @property
    def tokens_per_sample(self) -> int:
        """What a sample counts in rows and throughput: its tokens (a token kind), or itself."""
        return model_kind(self.model.kind).tokens_per_sample(self.data.seq_len)

    @property
    def workload(self) -> Workload:
        """What nn/ needs of the job (its cost model, its profiles): [model], [data], the
        chunks, M, the micro-batch size and the seed."""
        return Workload(
            model=self.model,
            data=self.data,
            chunks=self.grid.pp * self.train.virtual_stages,
            microbatches=self.train.microbatches,
            microbatch_size=self.microbatch_size,
            seed=self.train.seed,
        )

    def gradient_settings(self, backend: Backend = CPU) -> GradientSettings:
        """The gradient buckets' and rings' settings ([comm], train.shard_optimizer), made here
        once for comm.buckets. backend: where the gradients live; a GPU's buckets go after the
        step (its arrays belong to the main thread's device context)."""
        c = self.comm
        ring = RingSettings(
            codec=get_codec(c.codec, c.block),
            error_feedback=c.error_feedback,
            segment=c.segment_kb * 256,
            backend=backend,
        )
        weights = None
        if self.train.shard_optimizer:  # the weight gather: comm.param_codec, no residual
            codec = get_codec(c.param_codec or "fp32", c.block)
            weights = dataclasses.replace(ring, codec=codec, error_feedback=False)
        return GradientSettings(
            ring=ring,
            bucket_bytes=c.bucket_kb * 1024,
            progress=c.overlap if backend.xp is np else "off",
            weights=weights,
        )

    def runtime_settings(self, backend: Backend = CPU, wire: P2PWire | None = None):
        """The pipeline runtime's settings (train.microbatches, the model kind's loss,
        comm.sync_sends; the links comm.p2p_codec encodes: pipeline.wire.P2PWire.build), made
        here once."""
        from mpihybrid.pipeline.runtime import RuntimeSettings

        return RuntimeSettings(
            num_microbatches=self.train.microbatches,
            loss=model_kind(self.model.kind).loss,
            sync_sends=self.comm.sync_sends,
            backend=backend,
            wire=wire if wire is not None else P2PWire(),
            slowdown=Slowdown.parse(self.train.slowdown),
        )


_SECTIONS = [f for f in fields(Job) if f.metadata.get("section", True)]
SECTIONS = {f.name: f.type for f in _SECTIONS}
SECTION_TYPES = {f.name: f.default_factory for f in _SECTIONS}
