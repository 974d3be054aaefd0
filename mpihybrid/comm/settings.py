"""How a run's gradient rings and buckets work: settings made once from the job's [comm] (and
train.shard_optimizer) by `config.Job.gradient_settings(backend)`, then handed down by name.

    ring = RingAllreduce(dp_comm, count, RingSettings(get_codec("int8"), segment=4096))
    comm = GradientComm(dp_comm, GradientSettings(ring=..., bucket_bytes=4 << 20))

A ring of another codec is `dataclasses.replace(settings, codec=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpihybrid.comm.codecs import Codec, get_codec
from mpihybrid.comm.device import CPU, Backend

DEFAULT_SEGMENT = 1 << 19  # elements per message: 2 MiB of float32 (measured: bench allreduce)
TRANSPORTS = ("auto", "mpi")  # auto: shared memory where the whole ring is on one node
PROGRESS = ("thread", "poll", "off")  # how the buckets' rings move behind the compute


@dataclass(frozen=True)
class RingSettings:
    """One ring's settings (comm.allreduce.RingAllreduce, comm.hier_ring.TwoLevelRing)."""

    codec: Codec = field(default_factory=lambda: get_codec("fp32"))  # what goes on the wire
    error_feedback: bool = True  # a lossy codec's error joins the next call (comm.error_feedback)
    segment: int = DEFAULT_SEGMENT  # elements per message (comm.segment_kb x 256)
    transport: str = "auto"  # auto: a lossy ring on one node reads shared memory; mpi: messages
    backend: Backend = field(default_factory=lambda: CPU)  # where the vector lives (comm.device)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        if self.segment < 1:
            raise ValueError(f"segment must be >= 1 element, got {self.segment}")


@dataclass(frozen=True)
class GradientSettings:
    """A rank's gradient buckets (comm.buckets.GradientComm): their rings, their size, how they
    make progress, and (train.shard_optimizer) the weight gather's ring."""

    ring: RingSettings = field(default_factory=RingSettings)  # every bucket's gradient ring
    bucket_bytes: int = 4 << 20  # whole layers of at least this many bytes (comm.bucket_kb)
    progress: str = "thread"  # thread | poll | off (comm.overlap)
    # the distributed optimizer's weight all-gather (comm.param_codec, no error feedback);
    # None: not sharded, each bucket's ring all-reduces
    weights: RingSettings | None = None

    def __post_init__(self) -> None:
        if self.progress not in PROGRESS:
            raise ValueError(
                f"comm.overlap = {self.progress!r}: choose one of {', '.join(PROGRESS)}"
            )

    @property
    def sharded(self) -> bool:
        return self.weights is not None
