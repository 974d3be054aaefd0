"""A rank's memory, the one model: what `mpihybrid predict` reports per rank and what the check
before a run compares with the node's MemAvailable.

    parts = rank_memory(job, stage_work(job.workload), actions, ring_shared=False)["parts"]
    need = rank_estimate(job, pp_rank)     # bytes by part, from the job alone
    check_fits(job, world)                 # collective: ConfigError on every rank when a node's
                                           # ranks together need more than its MemAvailable or
                                           # their memory cgroup's limit (SLURM --mem) allows

Counted from the job and the layers' own cost declarations (nn/cost.py): parameters, gradients,
optimizer state, the error-feedback residual and the ring's buffers; the activations in flight by
the liveness rule over the rank's action list; the receive buffers; the data set and one step's
batch; the largest temporary of a pass; and the runtime (interpreter, libraries, MPI: a cluster
file's base_memory_bytes; 0 in the check, which refuses what cannot fit before numpy fails with a
traceback halfway through building the model). Nothing is allocated: `model.hidden = 1000000000`
is counted, not built. GPU runs (`grid.device = "cuda"`) keep the model on the device and are not
checked here.
"""

from __future__ import annotations

import logging
import math
import socket
from pathlib import Path

from mpi4py import MPI

from mpihybrid.comm.agree import first_error
from mpihybrid.comm.buckets import ring_kind
from mpihybrid.comm.codecs import get_codec
from mpihybrid.comm.nodes import NodeMapError, node_map
from mpihybrid.config import ConfigError, Job
from mpihybrid.nn.cost import ChunkWork, stage_work
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.kinds import model_kind
from mpihybrid.pipeline.actions import split_backwards
from mpihybrid.pipeline.liveness import Liveness
from mpihybrid.pipeline.schedules import Action
from mpihybrid.pipeline.vocab_passes import VOCAB_KINDS
from mpihybrid.train import vocab_build
from mpihybrid.train.tie import held_nbytes
from mpihybrid.units import human_bytes

FLOAT = 4  # bytes of a float32


def data_bytes(job: Job) -> int:
    """What a rank holds of the data: the data set (teacher: every sample's features and label;
    token tasks draw each batch fresh) and one step's batch: the global batch every rank draws
    and its replica's micro-batches, copied out of it."""
    d, t = job.data, job.train
    if d.kind == "teacher":
        per_sample = d.features * FLOAT + 8
        batch = t.global_batch * per_sample + t.global_batch // job.grid.dp * d.features * FLOAT
        # the samples are drawn in float64 and kept in float32, and the labels computed from a
        # float64 copy: 12 bytes a feature at once, which malloc's heap keeps resident after
        # (comm.device.keep_freed_host_memory; measured: 26 MiB for the 8.6 counted before)
        drawn = (d.train_samples + d.test_samples) * (d.features * (FLOAT + 8) + 8)
        return drawn + batch
    return 2 * 8 * d.seq_len * (t.global_batch + d.test_samples)  # tokens and targets, int64


def wcache_bytes(work: ChunkWork) -> int:
    """Bytes a split backward keeps from its B to its W for one micro-batch: the operands of
    the W's GEMMs (each Linear's input and output gradient)."""
    return sum(FLOAT * b * (m * k + k * n) for b, m, k, n in work.gemms("W"))


def rank_memory(
    job: Job,
    work: list[ChunkWork],
    actions: list[Action],
    ring_shared: bool,
    base_bytes: float = 0.0,
    *,
    memory_bytes: float = 0.0,
    ways: int = 0,
) -> dict:
    """Bytes one rank (its pp position's actions) holds at its peak, by part. ring_shared: a
    lossy ring whose encoded segments the neighbours read from a shared window (comm.shm: one
    node, host memory) needs no receive slots. base_bytes: the runtime itself; memory_bytes: the
    device's, for `fits` (0: not compared). ways: over how many ranks the gradient ring's
    reduce-scatter cuts the vector and train.shard_optimizer its state (shard_ways; 0: grid.dp,
    the flat ring)."""
    t, c, g = job.train, job.comm, job.grid
    ways = ways or g.dp
    actions = [a for a in actions if a.kind not in VOCAB_KINDS]  # the share: share_memory
    mine = sorted({a.stage for a in actions})
    placement = job.schedule.placement
    rank = placement.rank_of(mine[0])
    share = vocab_build.share_memory(job, rank, placement)  # model.vocab_parallel's share
    params = sum(work[s].params for s in mine) + share["params"]
    ring = _ring_bytes(job, params, ring_shared, ways)
    live = _live_activations(job, work, actions, mine)
    # every receive of a step is posted when it starts: one buffer per (direction, mb)
    last, recv = len(work) - 1, 0
    for s in mine:
        if s > 0 and placement.rank_of(s - 1) != rank:
            recv += t.microbatches * work[s].input_bytes  # activations from the previous chunk
        if s < last and placement.rank_of(s + 1) != rank:
            recv += t.microbatches * work[s + 1].input_bytes  # their gradients from the next
    per_param = {"adamw": 2, "sgd": 1 if t.momentum else 0}[t.optimizer]  # moments, velocity
    # train.shard_optimizer: state for the owned 1/ways; a lossy weight gather adds the owner's
    # fp32 master of it and the gather's encoded vector once (the owner's chunk, encoded where
    # nothing lands, and the others', received or read from their shared slots)
    owned = math.ceil(params / ways) if t.shard_optimizer else params
    gather = get_codec(c.param_codec or "fp32", c.block)
    if t.shard_optimizer and gather.lossy and g.dp > 1:
        ring += FLOAT * owned + gather.nbytes(params)
    parts = {
        "parameters": FLOAT * params,
        "gradients": FLOAT * params,
        "optimizer state": FLOAT * owned * per_param,
        "tied embedding": _tie_bytes(job, placement, mine, len(work)),
        "ring buffers": int(ring),
        "activations": int(live.peak_total_bytes) + share["activations"],
        "receive buffers": int(recv) + share["buffers"],
        "data": data_bytes(job),
        "temporaries": max(share["temporary"], *(work[s].largest_temporary for s in mine)),
        "merged W scratch": _merged_w_bytes(job, work, actions),
        "runtime": int(base_bytes),
    }
    # the held-out evaluation runs its pieces (train.evaluate) where the step's activations are
    # freed: the rank needs the larger of the two, so only what a piece holds beyond them counts
    parts["evaluation"] = max(0, _evaluation_bytes(job, work, mine) - parts["activations"]
                              - parts["temporaries"])  # fmt: skip
    total = sum(parts.values())
    held = ("parameters", "gradients", "optimizer state", "tied embedding", "ring buffers")
    state = sum(parts[k] for k in held)
    return {
        "rank": rank,
        "stages": mine,
        "params": params,
        "parts": parts,
        "state_bytes": state,
        "activation_bytes": parts["activations"],
        "activation_bytes_per_stage": {s: int(live.peak_bytes[s]) for s in mine},
        "buffer_bytes": parts["receive buffers"],
        "data_bytes": parts["data"],
        "temporary_bytes": parts["temporaries"],
        "base_bytes": parts["runtime"],
        "total_bytes": total,
        "fits": bool(not memory_bytes or total <= memory_bytes),
    }


def _merged_w_bytes(job: Job, work: list[ChunkWork], actions: list[Action]) -> int:
    """train.merge_w: nn/gemm's gather scratch, one for the process and kept between steps, as
    large as the rank's largest merged W gathers (its widest Linear's rows of every micro-batch
    it merges); 0 where no W is merged."""
    rows = job.workload.rows
    sizes = [work[a.stage].merged_w_bytes(rows * len(a.microbatches)) for a in actions if a.merged]
    return max(sizes, default=0)


def _tie_bytes(job: Job, placement, mine: list[int], num_stages: int) -> int:
    """model.tie_embeddings: what a rank holds for the tie beyond its chunks' parameters (which
    count the table once and the head's weight nowhere): train/tie.py's mirror and gradients."""
    if not model_kind(job.model.kind).stages_tie(job.model):  # vocab_parallel: no mirror
        return 0
    ranks = {placement.rank_of(s) for s in mine}
    first, last = placement.rank_of(0) in ranks, placement.rank_of(num_stages - 1) in ranks
    return held_nbytes(first, last, task_dims(job.data)[1], job.model.hidden)


def _ring_bytes(job: Job, params: int, ring_shared: bool, ways: int) -> int:
    """The gradient ring's buffers for `params` parameters: the error-feedback residual, the
    encoded vectors and the reduce-scatter's receive slots (its chunks 1/ways of the vector;
    under the two-level ring those inside the node, the larger ones)."""
    t, c, g = job.train, job.comm, job.grid
    codec = get_codec(c.codec, c.block)
    lossy = codec.lossy and g.dp > 1
    ring = FLOAT * params if lossy and c.error_feedback else 0  # the residual
    # the reduce-scatter receives step s into slot s % 2 of two chunk-sized ones (comm.allreduce)
    slots = min(2, ways - 1)
    if lossy:  # per bucket: its encoded vector twice (the wire and the all-gather's, or on one
        # node the neighbours' shared slots it decodes from), and apart from those the slots;
        # sharded, off one node, the reduce-scatter alone: its wire once
        ring += (1 if t.shard_optimizer and not ring_shared else 2) * codec.nbytes(params)
        if not ring_shared:
            ring += slots * codec.nbytes(math.ceil(params / ways))
    elif g.dp > 1:
        ring += slots * FLOAT * math.ceil(params / ways)
    return ring


def shard_ways(job: Job, pp_rank: int, rank: int, nodes: list[int] | None) -> int:
    """Over how many ranks world rank `rank`'s gradient ring cuts the vector (its reduce-scatter
    chunks; train.shard_optimizer: its optimizer state): the dp group under the flat ring; under
    the two-level ring (comm.hier_ring, a group spanning nodes: comm.buckets.ring_kind) the
    group's ranks on this rank's node, so a node holding fewer of them holds more each."""
    group = job.grid.layout.replica_ranks(pp_rank)
    if nodes is None or job.grid.dp == 1:
        return job.grid.dp
    if ring_kind(job.comm.ring, [nodes[r] for r in group])[0] != "hierarchical":
        return job.grid.dp
    return sum(nodes[r] == nodes[rank] for r in group)


def _live_activations(
    job: Job, work: list[ChunkWork], actions: list[Action], mine: list[int]
) -> Liveness:
    """The rank's activations replayed over its actions (liveness.py); peak_total_bytes is its
    peak, with recompute's weight caches and its one forward done again."""
    split = split_backwards(actions)
    live = Liveness(split)
    recompute = job.train.recompute == "full"  # a micro-batch in flight keeps its input alone
    waiting, peak = {}, 0  # recompute: a split B's W caches until its W, and the peak with them
    for a in actions:
        held = work[a.stage].input_bytes if recompute else work[a.stage].activation_bytes
        live.action(a, held)
        if recompute and (a.stage, a.microbatch) in split and a.kind in "BW":
            if a.kind == "B":  # what its W's GEMMs read: the Linear inputs, output gradients
                waiting[a.stage, a.microbatch] = wcache_bytes(work[a.stage])
            else:
                for mb in a.microbatches:
                    waiting.pop((a.stage, mb))
        peak = max(peak, live.total_bytes + sum(waiting.values()))
    if recompute:  # and one micro-batch's forward cache lives again during its backward
        live.peak_total_bytes = peak + max(work[s].activation_bytes for s in mine)
    return live


def _evaluation_bytes(job: Job, work: list[ChunkWork], mine: list[int]) -> int:
    """What an evaluation piece holds on this rank at most: its widest chunk's activations for
    the piece's rows (EVAL_BYTES at most) and, on the last chunk's rank, its logits."""
    from mpihybrid.nn.cost import FLOAT
    from mpihybrid.train.evaluate import EVAL_BYTES, EVAL_LOGITS

    per_sample = max(work[s].activation_bytes for s in mine) / job.microbatch_size
    held = min(EVAL_BYTES, per_sample * max(job.data.test_samples, 1))
    if len(work) - 1 in mine:
        _, classes = task_dims(job.data)
        tokens = model_kind(job.model.kind).tokens_per_sample(job.data.seq_len)
        held += FLOAT * min(EVAL_LOGITS, max(job.data.test_samples, 1) * tokens * classes)
    return int(held)


def rank_estimate(
    job: Job, pp_rank: int, ring_shared: bool = False, ways: int = 0
) -> dict[str, int]:
    """Bytes a rank at pipeline position `pp_rank` needs, by part (rank_memory's, without the
    runtime): from the job alone, nothing allocated. ways: shard_ways (0: grid.dp)."""
    actions = list(job.schedule.compute[pp_rank])
    parts = rank_memory(job, stage_work(job.workload), actions, ring_shared, ways=ways)["parts"]
    return {k: v for k, v in parts.items() if k != "runtime"}


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    return proc_kib("/proc/meminfo", "MemAvailable")


UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < UNLIMITED else None


def cgroup_headroom(
    root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> tuple[int, str] | None:
    """The bytes this process's memory cgroup (what SLURM's --mem and containers set) still lets
    its processes use, the tightest of the cgroup and its parents, and words naming that limit;
    None where no limit is set or cgroups cannot be read. cgroup v2 (memory.max, memory.current)
    and v1 (memory.limit_in_bytes, memory.usage_in_bytes)."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    base = Path(root)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "" and (base / "cgroup.controllers").exists():  # v2, unified
            mount, limit_name, usage_name = base, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            mount, limit_name, usage_name = (
                base / "memory",
                "memory.limit_in_bytes",
                ("memory.usage_in_bytes"),
            )
        else:
            continue
        here = mount / rel.lstrip("/")
        if not here.is_dir():  # a container sees its own cgroup at the mount's root
            here = mount
        best = None
        node = here
        while True:
            limit, usage = _read_int(node / limit_name), _read_int(node / usage_name)
            if limit is not None:
                room = max(limit - (usage or 0), 0)
                if best is None or room < best[0]:
                    words = (
                        f"the memory cgroup's limit ({node / limit_name}: {human_bytes(limit)}, "
                        f"{human_bytes(usage or 0)} in use)"
                    )
                    best = (room, words)
            if node == mount or mount not in node.parents:
                break
            node = node.parent
        if best is not None:
            return best
    return None


def address_space_limit() -> int | None:
    """RLIMIT_AS (`ulimit -v`) of this process in bytes, None when unlimited."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def proc_kib(path: str, key: str) -> int | None:
    """A `Key:  N kB` line of a /proc file (/proc/self/status, /proc/meminfo) in bytes; None
    where there is no such file or line."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _vm_size() -> int:
    """This process's mapped address space now (VmSize), 0 where unknown."""
    return proc_kib("/proc/self/status", "VmSize") or 0


def peak_rss_bytes() -> int:
    """This process's peak resident set in bytes (VmHWM of /proc/self/status; where there is no
    such file, getrusage's ru_maxrss, which cannot be reset)."""
    peak = proc_kib("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
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


def load_kernels(job: Job, say: bool = False) -> None:
    """A tiny model of the job's kind and optimizer, one forward, backward and update: numba
    loads from its disk cache (or compiles) every kernel a step calls, 40-46 MiB a rank
    (measured, MLP and GPT), now rather than in the first step, so that the memory check reads
    it as in use instead of missing it. A no-op without numba or on a GPU. say: log that they
    compile when numba's cache does not hold them (rank 0)."""
    from mpihybrid import _numba

    if not _numba.ENABLED or job.grid.device != "cpu":
        return
    if say and not _numba.kernels_cached():
        logging.getLogger("mpihybrid").info(
            "compiling kernels (numba): about half a minute, before the memory check; cached after"
        )
    import dataclasses

    import numpy as np

    from mpihybrid.nn.data import build_task, replica_microbatches
    from mpihybrid.nn.model import build_stage
    from mpihybrid.nn.optim import build_optimizer

    m, d = job.model, job.data
    tokens = d.kind != "teacher"
    model = dataclasses.replace(m, hidden=4 * m.heads, depth=1, ffn=0, partition="uniform")
    data = dataclasses.replace(
        d,
        kind="random-tokens" if tokens else d.kind,
        vocab=min(d.vocab, 64),
        seq_len=min(d.seq_len, 8),
        features=min(d.features, 8),
        train_samples=8,
        test_samples=4,
    )
    task = build_task(data)
    stage = build_stage(model, task.in_features, task.num_classes, 0, 1, seed=0)
    optimizer = build_optimizer(job.train, stage.flat_params)
    stage.zero_grad()
    for x, _ in replica_microbatches(task, 0, 4, 0, 1, num_microbatches=1):
        y, cache = stage.forward(x)
        stage.backward(np.full_like(y, 1e-3), cache)
    optimizer.begin_step()
    optimizer.update(stage.flat_grads, 0, stage.flat_params.size)


def check_fits(
    job: Job,
    world: MPI.Comm,
    available: int | None = None,
    cgroup: tuple[int, str] | None | bool = True,
) -> None:
    """Collective: every rank estimates its own need; the ranks of each node add theirs up and
    compare with what the node lets them have: MemAvailable, or less where the job's memory
    cgroup (SLURM's --mem) leaves less; each rank's need also against its RLIMIT_AS. ConfigError
    on every rank (the same message) when a node cannot hold its ranks. `available`, `cgroup`:
    what to compare with (tests); None / True read /proc/meminfo and the cgroup."""
    g = job.grid
    rank = world.Get_rank()
    pp_rank, _ = g.layout.coords(rank)
    try:
        load_kernels(job, say=rank == 0)  # in use from now on: counted in what is in use
    except Exception:  # a model the tiny copy cannot mirror: its kernels load in step 1
        pass
    try:
        nodes = node_map(world)  # collective
    except NodeMapError:  # the run's build says so, in one line
        nodes = None
    ways = shard_ways(job, pp_rank, rank, nodes)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ranks = node.Get_size()
        # every rank on one node: a lossy ring's wire is a shared window (comm.shm)
        shared = ranks == world.Get_size()
        need = rank_estimate(job, pp_rank, shared, ways) if g.device == "cpu" else {}
        node_need = node.allreduce(sum(need.values()))
    finally:
        node.Free()
    available = mem_available() if available is None else available
    limit_words = f"{human_bytes(available)} is available" if available is not None else ""
    room = cgroup_headroom() if cgroup is True else cgroup or None
    if room is not None and (available is None or room[0] < available):
        available, limit_words = room[0], f"{room[1]} leaves {human_bytes(room[0])}"
    error = None
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in need.items() if v)
    if available is not None and node_need > available:
        error = (
            f"the job needs about {human_bytes(node_need)} of memory on {socket.gethostname()} "
            f"({ranks} ranks; rank {rank}: {parts}) but {limit_words}"
        )
    address_space = address_space_limit()
    if error is None and address_space is not None and need:
        mapped = _vm_size()
        if mapped + sum(need.values()) > address_space:
            error = (
                f"rank {rank} needs about {human_bytes(sum(need.values()))} more memory ({parts}) "
                f"and already maps {human_bytes(mapped)}, past its address-space limit "
                f"RLIMIT_AS (ulimit -v) {human_bytes(address_space)}"
            )
    first = first_error(world, error)
    if first is not None:
        raise ConfigError(first)
