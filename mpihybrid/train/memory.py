"""Host memory a rank will need, estimated from the job before anything is allocated.

    need = rank_estimate(job, pp_rank)     # bytes by part: parameters, gradients, optimizer, ...
    check_fits(job, world)                 # collective: ConfigError on every rank when a node's
                                           # ranks together need more than its MemAvailable

An estimate, meant to refuse what cannot fit (`model.hidden = 1000000000`) with the numbers,
before numpy fails with a traceback halfway through building the model. It counts the large
arrays (fp32 flat parameters and gradients, optimizer state, the ring's residual and wire buffers,
the activations of the micro-batches a schedule keeps alive, the data set); Python, numpy and MPI
themselves come on top. GPU runs (`grid.device = "cuda"`) keep the model on the device and are
not checked here.
"""

from __future__ import annotations

import socket

from mpi4py import MPI

from mpihybrid.config import ConfigError, Job
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.model import stage_num_params
from mpihybrid.pipeline.schedules import stage_rank
from mpihybrid.units import human_bytes

FLOAT = 4  # bytes of a float32


def _inflight(job: Job) -> int:
    """Micro-batches whose activations a stage holds at once: every one for GPipe and the
    naive schedule, at most pp x v for the 1F1B family."""
    t = job.train
    if t.schedule in ("gpipe", "naive"):
        return t.microbatches
    return min(t.microbatches, job.grid.pp * t.virtual_stages)


def _activation_bytes(job: Job, in_features: int, num_classes: int, params: int, mb: int) -> int:
    """One micro-batch's cached activations on a chunk of `params` parameters (rough: the
    forward keeps a few arrays of the layer widths per sample)."""
    m = job.model
    if m.kind == "gpt":
        # per layer and sequence: about 8 C + 3 FFN floats a token, and the attention
        # probabilities (heads x T x T); the logits of the head twice (softmax and gradient)
        t, c, ffn = job.data.seq_len, m.hidden, m.ffn or 4 * m.hidden
        layers = params // max(4 * c * c + 2 * c * ffn, 1)
        per_layer = t * (8 * c + 3 * ffn) + m.heads * t * t
        return FLOAT * mb * (layers * per_layer + 2 * t * num_classes)
    widths = (m.hidden * (m.depth - 1) + num_classes + in_features) / max(m.depth, 1)
    layers = max(params // max(int(widths * widths), 1), 1)
    return int(FLOAT * mb * 3 * widths * layers)


def rank_estimate(job: Job, pp_rank: int) -> dict[str, int]:
    """Bytes the large arrays of a rank at pipeline position `pp_rank` take, by part."""
    g, t, c = job.grid, job.train, job.comm
    in_features, num_classes = task_dims(job.data)
    num_stages = g.pp * t.virtual_stages
    counts = stage_num_params(job.model, in_features, num_classes, num_stages)
    mine = [
        counts[s] for s in range(num_stages) if stage_rank(s, g.pp, t.virtual_stages) == pp_rank
    ]
    n = sum(mine)
    optimizer = {"sgd": 1 if t.momentum else 0, "adamw": 2}[t.optimizer]
    lossy = c.codec != "fp32" and g.dp > 1
    mb = max(t.global_batch // (g.dp * t.microbatches), 1)
    d = job.data
    if d.kind == "teacher":
        data = FLOAT * (d.train_samples + d.test_samples) * (d.features + 1)
    else:
        data = 8 * 2 * d.test_samples * d.seq_len
    return {
        "parameters": FLOAT * n,
        "gradients": FLOAT * n,
        "optimizer state": FLOAT * n * optimizer,
        "ring buffers": FLOAT * n * (2 if lossy else 1) if g.dp > 1 else 0,
        "activations": _inflight(job)
        * sum(_activation_bytes(job, in_features, num_classes, p, mb) for p in mine),
        "data": data,
    }


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set in bytes (VmHWM of /proc/self/status; where there is no
    such file, getrusage's ru_maxrss, which cannot be reset)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Start the peak resident set over from the current one (Linux >= 4.0: "5" to
    /proc/self/clear_refs), so that a later peak_rss_bytes() covers only what came after.
    False where the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def check_fits(job: Job, world: MPI.Comm, available: int | None = None) -> None:
    """Collective: every rank estimates its own need; the ranks of each node add theirs up and
    compare with the node's MemAvailable. ConfigError on every rank (the same message) when a
    node cannot hold its ranks. `available`: the bytes to compare with (tests); None reads
    /proc/meminfo."""
    g = job.grid
    rank = world.Get_rank()
    pp_rank = rank % g.pp if g.order == "pipeline-inner" else rank // g.dp
    need = rank_estimate(job, pp_rank) if g.device == "cpu" else {}
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        node_need = node.allreduce(sum(need.values()))
        ranks = node.Get_size()
    finally:
        node.Free()
    available = mem_available() if available is None else available
    error = None
    if available is not None and node_need > available:
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in need.items() if v)
        error = (
            f"the job needs about {human_bytes(node_need)} of memory on {socket.gethostname()} "
            f"({ranks} ranks; rank {rank}: {parts}) but {human_bytes(available)} is available"
        )
    first = next((e for e in world.allgather(error) if e is not None), None)
    if first is not None:
        raise ConfigError(first)
