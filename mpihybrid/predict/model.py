"""The cost model: a job's per-action times and bytes from its model, the device and the links,
composed by the schedule simulator into step time, throughput, bubble, exposed communication
and peak memory per rank.

    result = predict(job, load_cluster("a100_80gb"))   # a plain dict (JSON-ready)

Per chunk and micro-batch (nn.cost: what each layer declares beside its forward and backward):
    F, B, W   every GEMM (b, m, k, n): 2bmkn / gemm_flops + 4b(mk + kn + mn) / gemm_bandwidth
              + b gemm_call_s; every elementwise pass: its bytes / mem_bandwidth; every layer
              call: op_overhead_s. A merged W (train.merge_w): each Linear's GEMM once over its
              micro-batches' rows, after their gather (merged_weight_seconds)
    messages  alpha + bytes / bandwidth of the link between the two ranks (same node or not,
              from grid.order and ranks_per_node); where comm.p2p_codec encodes the link (one
              across nodes, or every link with p2p_codec_scope = "all") the codec's bytes (int8:
              a scale per row of model.hidden) and its encode and decode
    buckets   a stage's gradient in buckets of comm.bucket_kb (comm.buckets.bucket_ranges), each
              final when the stage's last B/W passes its first layer; its ring: 2(p-1) hops of
              an encoded chunk (a lossy ring on one node only says where its bytes lie: the
              neighbour decodes them from shared memory), the codec's encodes and decodes, the
              mean, (on a GPU) the host copies; then the optimizer on its slice (sharded: on
              its 1/dp, and the all-gather's hops carry comm.param_codec's bytes). A dp group
              that spans nodes under comm.ring = auto | hierarchical: the two-level ring
              (two_level_seconds: inside the node, across per chunk, inside). Buckets run
              one after the other (_rank_end); on one CPU core, the work of those that run while
              the rank still computes delays its compute by as much
    optimizer the bytes its implementation moves per parameter (optim.py) / optimizer_bandwidth
    per step  zero_grad and the batch's copies at mem_bandwidth, plus step_overhead_s
"""

from __future__ import annotations

import dataclasses

from mpihybrid import _numba
from mpihybrid.comm.buckets import bucket_ranges
from mpihybrid.comm.layout import ORDERS
from mpihybrid.config import Job
from mpihybrid.nn.cost import FLOAT, ChunkWork, Cost, Gemm, matmul_flops, stage_work
from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.vocab import share_layer
from mpihybrid.pipeline.actions import split_backwards
from mpihybrid.pipeline.schedules import Action
from mpihybrid.pipeline.simulate import Costs, SimResult, simulate
from mpihybrid.pipeline.vocab_passes import add_vocab_passes
from mpihybrid.predict.cluster import Cluster, Device, shared_cores
from mpihybrid.predict.wire import (
    _ring_crosses,
    job_placement,
    message_seconds,
    ring_seconds,
    shard_ways,
    shared_wire,
    tie_seconds,
    two_level,
)
from mpihybrid.train import memory

# bytes the optimizers of optim.py read and write per parameter: SGD's `p -= lr * g` is a
# temporary and an update (20), momentum adds `buf *= mu; buf += g` (20), weight decay a
# temporary and an add (20); AdamW's fused kernel reads p, g, m, v and writes p, m, v (28)
SGD_BYTES, MOMENTUM_BYTES, DECAY_BYTES, ADAMW_BYTES = 20, 20, 20, 28


def gemm_seconds(gemm: Gemm, d: Device) -> float:
    b, m, k, n = gemm
    memory = FLOAT * b * (m * k + k * n + m * n) / d.gemm_bandwidth if d.gemm_bandwidth else 0.0
    return matmul_flops(gemm) / d.gemm_flops + memory + b * d.gemm_call_s


def layer_seconds(layer: Cost, kind: str, d: Device) -> float:
    return (
        sum(gemm_seconds(g, d) for g in layer.gemms[kind])
        + layer.elem_bytes[kind] / d.mem_bandwidth
        + layer.calls[kind] * d.op_overhead_s
    )


def action_seconds(work: ChunkWork, kind: str, cluster: Cluster) -> float:
    return sum(layer_seconds(layer, kind, cluster.device) for layer in work.layers)


def merged_weight_seconds(work: ChunkWork, k: int, cluster: Cluster) -> float:
    """One merged W over k micro-batches (train.merge_w; nn/layers.Linear.backward_weight_merged):
    each Linear's x and dy rows gathered into nn/gemm's scratch (read and written, at
    mem_bandwidth), then its weight's GEMM once over the k micro-batches' rows: the gradient's
    traffic, the GEMM's call and the Linear's call paid once; the elementwise work (a bias, a
    norm) and the other layers' calls once per micro-batch, as the layers run them. k = 1: a W,
    which runs without a gather."""
    if k <= 1:
        return action_seconds(work, "W", cluster)
    d = cluster.device
    total = 0.0
    for layer in work.layers:
        calls = k * layer.calls["W"]
        total += k * layer.elem_bytes["W"] / d.mem_bandwidth
        for b, m, rows, n in layer.gemms["W"]:
            if not layer.merge_row_bytes:  # no gather: the GEMMs one by one
                total += k * gemm_seconds((b, m, rows, n), d)
                continue
            gather = 2 * FLOAT * b * k * rows * (m + n) / d.mem_bandwidth
            total += gemm_seconds((b, m, k * rows, n), d) + gather
            calls -= k - 1  # the Linear that runs this GEMM: one call for its k micro-batches
        total += calls * d.op_overhead_s
    return total


def merged_weight_more(job: Job, work: list[ChunkWork], cluster: Cluster) -> list[float] | None:
    """Costs.weight_more of the job's merge: per chunk, what each micro-batch beyond the first
    adds to a merged W of min(train.merge_w, M) members (None: nothing merges)."""
    k = min(job.train.merge_w, job.train.microbatches)
    if k <= 1:
        return None
    return [
        (merged_weight_seconds(w, k, cluster) - action_seconds(w, "W", cluster)) / (k - 1)
        for w in work
    ]


def optimizer_bytes(job: Job) -> int:
    t = job.train
    if t.optimizer == "adamw":
        return ADAMW_BYTES
    extra = (MOMENTUM_BYTES if t.momentum else 0) + (DECAY_BYTES if t.weight_decay else 0)
    return SGD_BYTES + extra


def optimizer_seconds(job: Job, params: int, cluster: Cluster) -> float:
    return params * optimizer_bytes(job) / cluster.device.optimizer_bandwidth


# ---------------------------------------------------------------------------------------------
# the step: buckets behind the compute


def _bucket_ready(
    work: ChunkWork, last: Action, split: bool, sim: SimResult, job: Job, *, cluster: Cluster
) -> list[tuple[float, int]]:
    """(time it is final, parameters) of each bucket of the stage, in the order they start:
    during the stage's last weight action, as its layers finish from the last."""
    ranges, lo = [], 0
    for layer in work.layers:
        ranges.append((lo, lo + layer.params))
        lo += layer.params
    kinds = ("W",) if split else ("B", "W")
    d = cluster.device
    cost = [sum(layer_seconds(layer, k, d) for k in kinds) for layer in work.layers]
    start, took = sim.start[last], sim.end[last] - sim.start[last]
    total = sum(cost) or 1.0
    out = []
    for b_lo, b_hi in bucket_ranges(ranges, job.comm.bucket_kb * 1024):
        first = next(i for i, (layer_lo, _) in enumerate(ranges) if layer_lo == b_lo)
        out.append((start + took * sum(cost[first:]) / total, b_hi - b_lo))
    return out


def _rank_end(
    job: Job, work: list[ChunkWork], sim: SimResult, actions: list[Action], cluster: Cluster
) -> dict:
    """When the rank's step ends as the runtime overlaps its buckets (comm.overlap): poll and
    thread start a bucket once it is final and the one before it is done; off, and a GPU (its
    ring runs on host copies), after the pipeline. On the rank's core, the work of a bucket that
    runs while the rank computes (poll: all of it, ring and update) delays the compute."""
    compute_end = max((sim.end[a] for a in actions if a in sim.end), default=0.0)
    mine = [a for a in actions if a.kind in ("F", "B", "W")]
    split = split_backwards(mine)
    last = {a.stage: a for a in mine if a.kind == "W" or (a.stage, a.microbatch) not in split}
    after = job.comm.overlap == "off" or cluster.device.host_copy_bandwidth > 0
    buckets = []  # (ready, stage, params)
    for s, a in last.items():
        for ready, n in _bucket_ready(
            work[s], a, (s, a.microbatch) in split, sim, job, cluster=cluster
        ):
            buckets.append((compute_end if after else ready, s, n))
    grads = [a for a in actions if a.kind == "G" and a in sim.end]
    if grads:  # model.vocab_parallel: the rank's share, one layer, final after its last G
        n = share_of(job).cost(1, job.model.hidden).params
        buckets.append((compute_end if after else sim.end[grads[-1]], mine[0].stage, n))
    shift = free = late_update = 0.0  # compute delayed by bucket work so far; when the last
    # bucket is done; updates of the buckets that start after the compute
    for ready, s, n in sorted(buckets, key=lambda b: b[0]):
        ring, work_s = ring_seconds(job, s, n, cluster)
        # sharded (ZeRO-1): the rank updates its 1/dp of the bucket
        ways = shard_ways(job, job_placement(job).rank_of(s), cluster)
        owned = n // ways if job.train.shard_optimizer else n
        update = optimizer_seconds(job, owned, cluster)
        start = max(ready + shift, free)
        free = start + ring + update
        if start < compute_end + shift:
            shift += (ring if job.comm.overlap == "poll" else work_s) + update
        else:
            late_update += update
    end = max(compute_end + shift, free)
    exposed = max(0.0, free - compute_end - shift)
    return {
        "end_s": end,
        "compute_end_s": compute_end + shift,
        "exposed_comm_s": exposed,  # ring and update past the compute
        "delay_s": shift,  # compute delayed by bucket work on the rank's core
        "exposed_ring_s": max(0.0, exposed - late_update),  # of it, the rings alone
    }


def step_work_seconds(job: Job, params: int, cluster: Cluster) -> float:
    """Per step and rank, outside the actions: zero_grad (a write of the gradients) and the
    batch: every rank draws the global batch (teacher data: a gather of its rows) and copies
    its replica's micro-batches."""
    d, t = job.data, job.train
    nbytes = FLOAT * params
    if d.kind == "teacher":
        nbytes += 2 * FLOAT * d.features * (t.global_batch + t.global_batch // job.grid.dp)
    return nbytes / cluster.device.mem_bandwidth + cluster.device.step_overhead_s


# ---------------------------------------------------------------------------------------------
# memory: the one model of train.memory, which the check before a run reads too


def rank_memory(job: Job, work: list[ChunkWork], actions: list[Action], cluster: Cluster) -> dict:
    """Bytes one rank (its pp position's actions) holds at its peak on `cluster`, by part."""
    rank = job_placement(job).rank_of(min(a.stage for a in actions if a.kind in "FBW"))
    d = cluster.device
    shared = shared_wire(True, _ring_crosses(job, rank, cluster), d)
    base = d.base_memory_bytes + (d.kernel_memory_bytes if runs_compiled_kernels(job) else 0.0)
    ways = shard_ways(job, rank, cluster)
    return memory.rank_memory(
        job, work, actions, shared, base, memory_bytes=cluster.node.memory_bytes, ways=ways
    )


def runs_compiled_kernels(job: Job) -> bool:
    """Whether a rank of the job loads numba's runtime: a GPT's layers, GELU, LayerNorm, AdamW
    and the lossy codecs have compiled kernels; a ReLU MLP with SGD and an fp32 ring none
    (measured: a fresh interpreter holds ~44 MiB more after its first compiled kernel)."""
    m, t, c = job.model, job.train, job.comm
    if not _numba.ENABLED or job.grid.device != "cpu":
        return False
    lossy = job.grid.dp > 1 and c.codec != "fp32"
    layers = bool(model_kind(m.kind).kernels(m))
    return layers or t.optimizer == "adamw" or lossy


# ---------------------------------------------------------------------------------------------


def pipeline(job: Job, cluster: Cluster) -> tuple:
    """(work, actions, costs, simulation) of the job's pipeline: what its codec and buckets do
    not change (the recommender reuses it across them)."""
    g, t = job.grid, job.train
    cluster = shared_cores(cluster, g.pp * g.dp)
    work = stage_work(job.workload)
    actions = job.schedule.lists()
    costs = Costs(
        forward=[action_seconds(w, "F", cluster) for w in work],
        # recompute = full: a backward first runs its forward again
        backward=[
            action_seconds(w, "B", cluster)
            + (action_seconds(w, "F", cluster) if t.recompute == "full" else 0.0)
            for w in work
        ],
        weight=[action_seconds(w, "W", cluster) for w in work],
        weight_more=merged_weight_more(job, work, cluster),
        send=message_seconds(job, work, cluster),
    )
    if job.model.vocab_parallel:  # every rank's share passes, placed as training places them
        costs = dataclasses.replace(costs, vocab=vocab_seconds(job, cluster))
        actions = add_vocab_passes(actions, job_placement(job), t.microbatches, costs, simulate)
    return work, actions, costs, simulate(actions, job_placement(job), costs)


def share_of(job: Job):
    """model.vocab_parallel: a rank's share of the vocabulary (nn/vocab.VocabShard; every
    rank's is the same size)."""
    return share_layer(job.model, job.data.seq_len, job.data.vocab, job.grid.pp, 0, seed=0)


def vocab_seconds(job: Job, cluster: Cluster) -> dict[str, float]:
    """model.vocab_parallel: seconds of a share's E, S, T and G passes on one micro-batch, from
    its declared cost (nn/vocab.py); E and G move the rows (gather, scatter-add)."""
    d = cluster.device
    rows = job.microbatch_size * job.data.seq_len
    cost = share_of(job).cost(rows, job.model.hidden)
    rows_pass = 12 * rows * job.model.hidden / d.mem_bandwidth + d.op_overhead_s
    return {
        "E": rows_pass,
        "S": layer_seconds(cost, "F", d),
        "T": layer_seconds(cost, "B", d) + layer_seconds(cost, "W", d),
        "G": rows_pass,
    }


def predict(job: Job, cluster: Cluster, piped: tuple | None = None) -> dict:
    """Everything `mpihybrid predict` reports for a resolved job on `cluster` (JSON-ready);
    `piped`: pipeline(job, cluster) when already computed. grid.order = auto: the prediction
    of the faster order (pipeline-inner on a tie, or when pp or dp is 1), which it names."""
    if job.grid.order == "auto":
        return _predict_auto(job, cluster)
    g, t = job.grid, job.train
    cluster = shared_cores(cluster, g.pp * g.dp)
    work, actions, costs, sim = piped or pipeline(job, cluster)
    memory = [rank_memory(job, work, actions[r], cluster) for r in range(g.pp)]
    ranks = []
    tied = job_placement(job)
    tied = {tied.rank_of(0), tied.rank_of(tied.num_stages - 1)}  # the tie's messages' ranks
    for r in range(g.pp):
        overhead = step_work_seconds(job, memory[r]["params"], cluster)
        overhead += tie_seconds(job, cluster) if r in tied else 0.0
        row = _rank_end(job, work, sim, actions[r], cluster)
        ranks.append({"rank": r, **row, "end_s": row["end_s"] + overhead})
    step = max(r["end_s"] for r in ranks)
    units = job.tokens_per_sample
    flops_step = sum(w.flops(k) for w in work for k in ("F", "B", "W")) * t.microbatches * g.dp
    if job.model.vocab_parallel:  # the shares' GEMMs, pp of them
        rows = job.microbatch_size * job.data.seq_len
        flops_step += (
            share_of(job).cost(rows, job.model.hidden).flops() * g.pp * t.microbatches * g.dp
        )
    stages = []
    for s, w in enumerate(work):
        ring = ring_seconds(job, s, w.params, cluster)[0]
        stages.append(
            {
                "stage": s,
                "params": w.params,
                "forward_s": costs.forward[s],
                "backward_s": costs.backward[s],
                "weight_s": costs.weight[s],
                "allreduce_s": ring,
                "optimizer_s": optimizer_seconds(job, w.params, cluster),
                "activation_bytes_per_microbatch": w.activation_bytes,
            }
        )
    return {
        "job": {
            "model": job.model.kind,
            "pp": g.pp,
            "dp": g.dp,
            "order": g.order,
            "schedule": t.schedule,
            "microbatches": t.microbatches,
            "virtual_stages": t.virtual_stages,
            "codec": job.comm.codec,
            "p2p_codec": job.comm.p2p_codec,
            "ring": "hierarchical"
            if any(two_level(job, r, cluster) for r in range(g.pp))
            else "flat",
            "overlap": job.comm.overlap,
            "global_batch": t.global_batch,
            "tie_embeddings": job.model.tie_embeddings,
            "vocab_parallel": job.model.vocab_parallel,
        },
        "cluster": cluster.name,
        "unit": "tokens" if units > 1 else "samples",
        "step_time_s": step,
        "throughput": t.global_batch * units / step,
        "bubble": sim.bubble_fraction,
        "pipeline_s": sim.makespan,
        "exposed_comm_s": max(r["exposed_comm_s"] for r in ranks),
        "efficiency": flops_step / (step * g.pp * g.dp * cluster.device.gemm_flops),
        "stages": stages,
        "message_s": costs.send,
        "ranks": ranks,
        "memory": memory,
        "peak_memory_bytes": max(m["total_bytes"] for m in memory),
        "memory_bytes": cluster.node.memory_bytes,  # of one device: what a rank must fit in
        "notes": _notes(job, cluster),
    }


def with_order(job: Job, order: str) -> Job:
    return dataclasses.replace(job, grid=dataclasses.replace(job.grid, order=order))


def order_predictions(job: Job, cluster: Cluster) -> tuple[str, dict[str, dict]]:
    """grid.order = auto's rule, for training (predict.auto) and predict alike: each order's
    prediction (pipeline-inner alone where pp or dp is 1) and the faster (a tie: pipeline-inner)."""
    both = job.grid.pp > 1 and job.grid.dp > 1
    orders = ORDERS if both else ("pipeline-inner",)
    found = {o: predict(with_order(job, o), cluster) for o in orders}
    best = max(orders, key=lambda o: (found[o]["throughput"], o == "pipeline-inner"))
    return best, found


def _predict_auto(job: Job, cluster: Cluster) -> dict:
    """grid.order = auto, as training resolves it (predict.auto) on the cluster's nodes."""
    best, found = order_predictions(job, cluster)
    found[best]["notes"].append(f"grid.order = auto: {best}")
    return found[best]


def _notes(job: Job, cluster: Cluster) -> list[str]:
    """What the prediction cannot see from this pair of job and cluster."""
    gpu = cluster.device.host_copy_bandwidth > 0
    if gpu and job.grid.device == "cpu":
        return [
            "the cluster's device is a GPU (host_copy_bandwidth > 0) but the job computes on "
            "the CPU (grid.device = cpu): the times are for the GPU"
        ]
    if not gpu and job.grid.device == "cuda":
        return [
            "the job computes on a GPU (grid.device = cuda) but the cluster's device has "
            "host_copy_bandwidth = 0: the times are for arrays on the host"
        ]
    return []
