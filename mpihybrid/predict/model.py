"""The cost model: a job's per-action times and bytes from its model, the device and the links,
composed by the schedule simulator into step time, throughput, bubble, exposed communication
and peak memory per rank.

    result = predict(job, load_cluster("clusters/local.toml"))   # a plain dict (JSON-ready)

Per stage and micro-batch (rows = samples x tokens per sample):
    F, B, W   GEMM FLOPs / gemm_flops + elementwise bytes / mem_bandwidth + layers x op_overhead_s
              (FLOPs from the layers' own flops(); B = dx GEMMs, attention's four backward
              matmuls included; W = dW GEMMs; elementwise bytes = the activation bytes a forward
              keeps alive, counted as the runtime counts them, once for F and twice for B)
    messages  alpha + bytes / bandwidth of the link between the two ranks (same node or not,
              from grid.order and ranks_per_node)
    ring      2(p-1) hops of one encoded chunk + encode/decode at the codec's rates (+ the host
              copies when the ring runs on host buffers); it starts when the stage's last B/W
              ends and runs on a communication thread, one stage after the other; the optimizer
              steps a stage once its reduction is done; exposed = ring time past the rank's
              last compute
    optimizer nominal bytes per parameter (SGD 12, with momentum 20, AdamW 28) / optimizer_bandwidth
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpihybrid.comm.codecs import get_codec
from mpihybrid.config import Job
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.layers import Layer, Linear
from mpihybrid.nn.model import Stage, boundary_shapes, build_blocks, chunk_ranges
from mpihybrid.nn.transformer import CausalAttention, Residual
from mpihybrid.pipeline.liveness import Liveness
from mpihybrid.pipeline.schedules import build_schedule, stage_rank
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.predict.cluster import Cluster, Link

FLOAT = 4  # bytes of a float32
OPTIMIZER_BYTES = {"sgd": 12, "sgd+momentum": 20, "adamw": 28}  # read + written per parameter
KINDS = ("F", "B", "W")


@dataclass
class StageWork:
    """One model chunk's work for one micro-batch, before any device is chosen."""

    flops: dict[str, float]  # F, B, W: GEMM FLOPs
    elem_bytes: dict[str, float]  # F, B, W: elementwise bytes
    ops: dict[str, int]  # F, B, W: layer calls
    params: int
    activation_bytes: int  # what one micro-batch's forward keeps alive (the runtime's count)
    input_bytes: int  # the activation this chunk receives per micro-batch (0: chunk 0)


def _leaves(block: list[Layer]) -> list[Layer]:
    return [
        sub for layer in block for sub in (layer.branch if isinstance(layer, Residual) else [layer])
    ]


def _zero_bound(block: list[Layer]) -> None:
    """Give the block zero parameters (a probe: values do not change what a cache holds)."""
    for layer in block:
        shapes = layer.param_shapes()
        layer.bind(
            {k: np.zeros(s, np.float32) for k, s in shapes.items()},
            {k: np.zeros(s, np.float32) for k, s in shapes.items()},
        )


_PROBES: dict[tuple, tuple] = {}


def _probe_block(block: list[Layer], x: np.ndarray) -> tuple[int, int, int, np.ndarray]:
    """(bytes the block's forward keeps alive, of them its input's, of them its output's, its
    output) on input x, counted by the runtime's own rule (Stage.activation_nbytes)."""
    key = (repr(block), x.shape, x.dtype.str)
    if key not in _PROBES:
        _zero_bound(block)
        y, caches = x, []
        for layer in block:
            y, cache = layer.forward(y)
            caches.append(cache)
        count = Stage.activation_nbytes(None, caches)  # the method uses no state of its own
        input_kept = count + x.nbytes - Stage.activation_nbytes(None, [caches, x])
        output_kept = count + y.nbytes - Stage.activation_nbytes(None, [caches, y])
        _PROBES[key] = (count, input_kept, output_kept, y.shape, y.dtype.str)
    count, input_kept, output_kept, shape, dtype = _PROBES[key]
    return count, input_kept, output_kept, np.zeros(shape, dtype)


def _chunk_activations(blocks: list, ranges: list[range], x: np.ndarray) -> list[int]:
    """Bytes one micro-batch's forward keeps alive on each chunk, for the model input x."""
    out = []
    for chunk in ranges:
        act, previous_kept = 0, 0
        for g_index in chunk:
            count, input_kept, output_kept, x = _probe_block(blocks[g_index], x)
            # the array between two blocks counts once when both keep it
            act += count - (input_kept if previous_kept else 0)
            previous_kept = output_kept
        out.append(act)
    return out


def activation_bytes(job: Job, blocks: list, ranges: list[range], samples: int) -> list[int]:
    """Each chunk's activations per micro-batch of `samples`, from forwards of tiny probes: an
    MLP's caches grow linearly with rows (probes of 1 and 2 rows), a GPT's as a t + c t^2 with
    the tokens t of a sequence (probes of 4 and 8 tokens, the attention probabilities are
    t x t), and linearly with sequences."""
    in_features = task_dims(job.data)[0]
    if job.model.kind == "gpt":
        b4, b8 = (_chunk_activations(blocks, ranges, np.zeros((1, t), np.int64)) for t in (4, 8))
        t = in_features
        return [
            samples * round((y4 - 16 * (y8 - 2 * y4) / 32) / 4 * t + (y8 - 2 * y4) / 32 * t * t)
            for y4, y8 in zip(b4, b8, strict=True)
        ]
    b1, b2 = (
        _chunk_activations(blocks, ranges, np.zeros((n, in_features), np.float32)) for n in (1, 2)
    )
    return [(y1 - (y2 - y1)) + samples * (y2 - y1) for y1, y2 in zip(b1, b2, strict=True)]


def _chunk_flops(blocks: list, chunk: range, rows: int) -> tuple[dict, dict, int]:
    """(GEMM FLOPs of F, B, W; layer calls of F, B, W; parameters) of one chunk."""
    flops = dict.fromkeys(KINDS, 0.0)
    ops = dict.fromkeys(KINDS, 0)
    params = 0
    for g_index in chunk:
        for i, layer in enumerate(_leaves(blocks[g_index])):
            f = rows * layer.flops(1)
            first = g_index == 0 and i == 0  # the model's first layer: no input gradient
            flops["F"] += f
            flops["B"] += 2 * f if isinstance(layer, CausalAttention) else (0 if first else f)
            flops["W"] += f if isinstance(layer, Linear) else 0
            shapes = layer.param_shapes()
            params += sum(math.prod(s) for s in shapes.values())
            ops["F"] += 1
            ops["B"] += 1
            ops["W"] += 1 if shapes else 0
    return flops, ops, params


def stage_work(job: Job) -> list[StageWork]:
    """Every chunk's work per micro-batch of `job` (pp x virtual_stages chunks)."""
    g, t, m = job.grid, job.train, job.model
    in_features, num_classes = task_dims(job.data)
    blocks = build_blocks(m, in_features, num_classes)
    num_chunks = g.pp * t.virtual_stages
    samples = t.global_batch // (g.dp * t.microbatches)
    rows = samples * (job.data.seq_len if m.kind == "gpt" else 1)
    shapes = boundary_shapes(m, in_features, num_classes, num_chunks, samples)
    ranges = chunk_ranges(m, blocks, num_chunks)
    acts = activation_bytes(job, blocks, ranges, samples)
    out = []
    for c, chunk in enumerate(ranges):
        flops, ops, params = _chunk_flops(blocks, chunk, rows)
        elem = {"F": float(acts[c]), "B": 2.0 * acts[c], "W": 0.0}
        if c == num_chunks - 1:  # the loss: softmax over the logits, forward and backward
            elem["F"] += 2 * FLOAT * rows * num_classes
        input_bytes = FLOAT * math.prod(shapes[c]) if c else 0
        out.append(StageWork(flops, elem, ops, params, acts[c], input_bytes))
    return out


def action_seconds(work: StageWork, kind: str, cluster: Cluster) -> float:
    d = cluster.device
    return (
        work.flops[kind] / d.gemm_flops
        + work.elem_bytes[kind] / d.mem_bandwidth
        + work.ops[kind] * d.op_overhead_s
    )


def optimizer_seconds(job: Job, params: int, cluster: Cluster) -> float:
    t = job.train
    name = "sgd+momentum" if t.optimizer == "sgd" and t.momentum else t.optimizer
    return params * OPTIMIZER_BYTES[name] / cluster.device.optimizer_bandwidth


# ---------------------------------------------------------------------------------------------
# placement: which ranks share a node


def world_rank(job: Job, pp_rank: int, dp_rank: int) -> int:
    g = job.grid
    if g.order == "pipeline-inner":
        return dp_rank * g.pp + pp_rank
    return pp_rank * g.dp + dp_rank


def _node(rank: int, cluster: Cluster) -> int:
    return rank // cluster.node.ranks_per_node


def _crossing(edges: list[tuple[int, int]], cluster: Cluster) -> tuple[bool, int]:
    """Whether any edge leaves its node, and the most crossing edges leaving one node."""
    out: dict[int, int] = {}
    for a, b in edges:
        if _node(a, cluster) != _node(b, cluster):
            out[_node(a, cluster)] = out.get(_node(a, cluster), 0) + 1
    return bool(out), max(out.values(), default=0)


def message_seconds(job: Job, work: list[StageWork], cluster: Cluster) -> float:
    """The slowest pipeline hop (activation or its gradient) between neighbouring chunks."""
    g, v = job.grid, job.train.virtual_stages
    worst = 0.0
    for c in range(1, len(work)):
        edges = [
            (
                world_rank(job, stage_rank(c - 1, g.pp, v), d),
                world_rank(job, stage_rank(c, g.pp, v), d),
            )
            for d in range(g.dp)
        ]
        if all(a == b for a, b in edges):
            continue  # both chunks on one rank (interleaved, pp = 1)
        crosses, flows = _crossing(edges, cluster)
        link = cluster.links["network" if crosses else "node"]
        worst = max(worst, link.seconds(work[c].input_bytes, flows))
    return worst


def ring_seconds(job: Job, chunk: int, params: int, cluster: Cluster) -> tuple[float, float]:
    """One stage's ring all-reduce: (seconds, of them the codec's work): 2(p-1) hops of a
    chunk, the codec's encodes and decodes, the host copies on a GPU."""
    g, c = job.grid, job.comm
    p = g.dp
    if p == 1 or params == 0:
        return 0.0, 0.0
    pp_rank = stage_rank(chunk, g.pp, job.train.virtual_stages)
    ranks = [world_rank(job, pp_rank, d) for d in range(p)]
    # every stage's ring runs at about the same time: count all of them on the node's way out
    all_edges = [
        (world_rank(job, r, d), world_rank(job, r, (d + 1) % p))
        for r in range(g.pp)
        for d in range(p)
    ]
    crosses, _ = _crossing([(ranks[d], ranks[(d + 1) % p]) for d in range(p)], cluster)
    _, flows = _crossing(all_edges, cluster)
    link: Link = cluster.links["network" if crosses else "node"]
    n = params / p
    codec = get_codec(c.codec, c.block)
    rate = cluster.codecs[c.codec]
    hops = 2 * (p - 1) * link.seconds(codec.nbytes(math.ceil(n)), flows)
    if (
        codec.lossy
    ):  # reduce-scatter: encode + decode-add per hop; all-gather: 1 encode, p-1 decodes
        work = (p - 1) * n * FLOAT * (1 / rate.encode + 1 / rate.decode)
        work += n * FLOAT / rate.encode + (p - 1) * n * FLOAT / rate.decode
    else:  # fp32: a received chunk is added (reduce-scatter) or lands in place (all-gather)
        work = (p - 1) * n * FLOAT / rate.decode
    host = cluster.device.host_copy_bandwidth
    copies = 2 * params * FLOAT / host if host else 0.0
    return hops + work + copies, work


# ---------------------------------------------------------------------------------------------
# the step


def _overlap(
    job: Job, sim, ring: list[tuple[float, float]], opt: list[float], rank: int, cluster: Cluster
) -> tuple[float, float, float]:
    """(end of the rank's step, its last compute end, exposed ring seconds) as the runtime
    overlaps: a stage's ring starts once its last B/W is done (on a GPU, whose rings run on host
    copies, once the pipeline is), one at a time on the communication thread, and the optimizer
    updates the stage right after its reduction. Codec and optimizer work that runs while the
    rank still computes shares its device: it delays the compute by as much."""
    g, v = job.grid, job.train.virtual_stages
    mine = [a for a in sim.end if stage_rank(a.stage, g.pp, v) == rank]
    compute_end = max((sim.end[a] for a in mine), default=0.0)
    stages = sorted({a.stage for a in mine})
    last = {s: max(sim.end[a] for a in mine if a.stage == s) for s in stages}
    if cluster.device.host_copy_bandwidth:
        last = dict.fromkeys(stages, compute_end)
    comm = shared = reduced = 0.0
    for s in sorted(stages, key=last.get):
        seconds, work = ring[s]
        start = max(comm, last[s])
        reduced = start + seconds
        comm = reduced + opt[s]
        if start < compute_end:
            shared += work + opt[s]
    end = max(compute_end + shared, comm)
    return end, compute_end, max(0.0, reduced - compute_end)


def _memory(job: Job, work: list[StageWork], actions, cluster: Cluster, rank: int) -> dict:
    """Bytes one rank holds at its peak: state, activations in flight, buffers, data, runtime."""
    t, c = job.train, job.comm
    mine = sorted({a.stage for a in actions[rank]})
    params = sum(work[s].params for s in mine)
    per_param = 2 + {"adamw": 2, "sgd": 1 if t.momentum else 0}[t.optimizer]  # p, g, state
    codec = get_codec(c.codec, c.block)
    lossy = codec.lossy and c.error_feedback
    state = FLOAT * params * (per_param + (1 if lossy else 0))
    if codec.lossy and job.grid.dp > 1:  # the encoded vector and a receive slot
        state += codec.nbytes(params) + 2 * codec.nbytes(math.ceil(params / job.grid.dp))
    split = {(a.stage, a.microbatch) for a in actions[rank] if a.kind == "W"}
    live = Liveness(split)
    for a in actions[rank]:
        live.step(a.kind, a.stage, a.microbatch, work[a.stage].activation_bytes)
    # every receive of a step is posted when it starts: one buffer per (direction, mb)
    g, last = job.grid, len(work) - 1
    recv = 0
    for s in mine:
        if s > 0 and stage_rank(s - 1, g.pp, t.virtual_stages) != rank:
            recv += t.microbatches * work[s].input_bytes  # activations from the previous chunk
        if s < last and stage_rank(s + 1, g.pp, t.virtual_stages) != rank:
            recv += t.microbatches * work[s + 1].input_bytes  # their gradients from the next
    d = job.data
    data = (
        (d.train_samples + d.test_samples) * (d.features * FLOAT + 8) if d.kind == "teacher" else 0
    )
    total = state + live.peak_total_bytes + recv + data + cluster.device.base_memory_bytes
    return {
        "rank": rank,
        "stages": mine,
        "params": params,
        "state_bytes": int(state),
        "activation_bytes": int(live.peak_total_bytes),
        "activation_bytes_per_stage": {s: int(live.peak_bytes[s]) for s in mine},
        "buffer_bytes": int(recv),
        "data_bytes": int(data),
        "base_bytes": int(cluster.device.base_memory_bytes),
        "total_bytes": int(total),
        "fits": bool(total <= cluster.node.memory_bytes),
    }


def predict(job: Job, cluster: Cluster) -> dict:
    """Everything `mpihybrid predict` reports for a resolved job on `cluster` (JSON-ready)."""
    g, t = job.grid, job.train
    work = stage_work(job)
    actions = build_schedule(t.schedule, g.pp, t.microbatches, t.virtual_stages, t.early_grad_send)
    costs = Costs(
        forward=[action_seconds(w, "F", cluster) for w in work],
        backward=[action_seconds(w, "B", cluster) for w in work],
        weight=[action_seconds(w, "W", cluster) for w in work],
        send=message_seconds(job, work, cluster),
    )
    sim = simulate(actions, costs, t.virtual_stages)
    ring = [ring_seconds(job, s, w.params, cluster) for s, w in enumerate(work)]
    opt = [optimizer_seconds(job, w.params, cluster) for w in work]
    ranks = []
    for r in range(g.pp):
        end, compute_end, exposed = _overlap(job, sim, ring, opt, r, cluster)
        ranks.append(
            {"rank": r, "end_s": end, "compute_end_s": compute_end, "exposed_comm_s": exposed}
        )
    step = max(r["end_s"] for r in ranks) + cluster.device.step_overhead_s
    units = job.data.seq_len if job.data.kind != "teacher" else 1
    flops_step = sum(sum(w.flops.values()) for w in work) * t.microbatches * g.dp
    memory = [_memory(job, work, actions, cluster, r) for r in range(g.pp)]
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
            "global_batch": t.global_batch,
        },  # fmt: skip
        "cluster": cluster.name,
        "unit": "tokens" if units > 1 else "samples",
        "step_time_s": step,
        "throughput": t.global_batch * units / step,
        "bubble": sim.bubble_fraction,
        "pipeline_s": sim.makespan,
        "exposed_comm_s": max(r["exposed_comm_s"] for r in ranks),
        "efficiency": flops_step / (step * g.pp * g.dp * cluster.device.gemm_flops),
        "stages": [
            {
                "stage": s,
                "params": w.params,
                "forward_s": costs.forward[s],
                "backward_s": costs.backward[s],
                "weight_s": costs.weight[s],
                "allreduce_s": ring[s][0],
                "optimizer_s": opt[s],
                "activation_bytes_per_microbatch": w.activation_bytes,
            }
            for s, w in enumerate(work)
        ],  # fmt: skip
        "message_s": costs.send,
        "ranks": ranks,
        "memory": memory,
        "peak_memory_bytes": max(m["total_bytes"] for m in memory),
        "notes": _notes(job, cluster),
    }


def _notes(job: Job, cluster: Cluster) -> list[str]:
    """What the prediction cannot see from this pair of job and cluster."""
    gpu = cluster.device.host_copy_bandwidth > 0
    if gpu and job.grid.device == "cpu":
        return ["the cluster's device is a GPU (host_copy_bandwidth > 0) but the job computes on "
                "the CPU (grid.device = cpu): the times are for the GPU"]  # fmt: skip
    if not gpu and job.grid.device == "cuda":
        return ["the job computes on a GPU (grid.device = cuda) but the cluster's device has "
                "host_copy_bandwidth = 0: the times are for arrays on the host"]  # fmt: skip
    return []
