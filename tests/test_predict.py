"""mpihybrid predict: cluster files, the cost model's pieces on made-up figures (exact
expectations), the CLI, and (marked mpi) the activation bytes the runtime counts.

How close a prediction comes to a timed run depends on the machine: that is measured by
benchmarks/predict_validation.py (docs/predict.md), never asserted here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mpihybrid.cli import main
from mpihybrid.config import build_job, load_table, resolve
from mpihybrid.nn.cost import stage_work
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.model import build_stage
from mpihybrid.predict.cluster import ClusterError, Link, load_cluster, parse_cluster
from mpihybrid.predict.microbench import GEMM_SHAPES, fit_gemm
from mpihybrid.predict.model import gemm_seconds, predict
from mpihybrid.predict.wire import ring_seconds
from mpihybrid.train.memory import peak_rss_bytes, reset_peak_rss
from tests.helpers import ROOT, run_mpi

A100 = ROOT / "clusters" / "a100_80gb.toml"
LOCAL = ROOT / "clusters" / "local.toml"


def _job(path: str, *sets: str):
    job = build_job(load_table(ROOT / path), list(sets))
    return resolve(job, job.grid.pp * job.grid.dp)


def _table() -> dict:
    import tomllib

    return tomllib.loads(A100.read_text())


def test_every_cluster_file_loads():
    for path in sorted((ROOT / "clusters").glob("*.toml")):
        cluster = load_cluster(path)
        assert cluster.device.gemm_flops > 0 and cluster.node.ranks_per_node >= 1, path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t["device"].pop("gemm_flops"), "missing field device.gemm_flops"),
        (lambda t: t["links"]["network"].update(bandwidth="fast"), "links.network.bandwidth"),
        (lambda t: t["codecs"].pop("int8"), "missing section [codecs.int8]"),
        (lambda t: t["device"].update(mem_bandwidth=-1), "must be >= 0"),
        (lambda t: t["node"].update(color=3), "unknown field node.color"),
    ],
)
def test_a_bad_cluster_field_is_named(edit, message):
    table = _table()
    edit(table)
    with pytest.raises(ClusterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_cluster(table)


def test_cli_bad_cluster_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(A100.read_text().replace("gemm_flops = 17.5e12", ""))
    result = CliRunner().invoke(main, ["predict", "jobs/laptop.toml", "--cluster", str(bad)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"mpihybrid: error: cluster file {str(bad)!r}: missing field device.gemm_flops"
    ]
    missing = CliRunner().invoke(main, ["predict", "jobs/nope.toml", "--cluster", str(A100)])
    assert missing.exit_code == 2 and "does not exist" in missing.output


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("device", "gemm_flops", 0, "must be > 0"),
        ("device", "mem_bandwidth", -3e9, "must be >= 0"),
        ("device", "optimizer_bandwidth", float("nan"), "must be a finite number"),
        ("device", "op_overhead_s", float("inf"), "must be a finite number"),
        ("links.network", "bandwidth", 0, "must be > 0"),
        ("codecs.int8", "decode", float("nan"), "must be a finite number"),
        ("node", "memory_bytes", 0, "must be > 0"),
    ],
)
def test_zero_negative_or_nan_rates_are_one_line_and_exit_2(tmp_path, section, key, value, message):
    table = _table()
    where = table
    for part in section.split("."):
        where = where[part]
    where[key] = value
    with pytest.raises(ClusterError, match=message):
        parse_cluster(table)
    path = tmp_path / "bad.toml"
    path.write_text(_toml(table))
    result = CliRunner().invoke(main, ["predict", "jobs/laptop.toml", "--cluster", str(path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"mpihybrid: error: cluster file {str(path)!r}: {section}.{key} = {value!r}: {message}"
    ]


def _toml(table: dict, where: str = "") -> str:
    """A parsed cluster table back to TOML (nan and inf as TOML writes them)."""

    def scalar(v):
        if isinstance(v, str):
            return json.dumps(v)
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(v), repr(v))

    lines = [f"{k} = {scalar(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for k, v in table.items():
        if isinstance(v, dict):
            name = f"{where}.{k}" if where else k
            lines += ["", f"[{name}]", _toml(v, name)]
    return "\n".join(lines)


def test_clusters_and_jobs_by_name_from_any_directory(tmp_path, monkeypatch):
    """The cluster files and example jobs install with the package: found from elsewhere."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for args in (["jobs/a100_gpt.toml", "--cluster", "a100_80gb"], ["gpt_bench", "--cluster",
                 "a100_40gb"], ["jobs/laptop.toml"]):  # fmt: skip
        result = CliRunner().invoke(main, ["predict", *args, "--json"])
        assert result.exit_code == 0, result.output
        r = json.loads(result.output)
        assert (
            Path(r["cluster_file"]).is_file() and Path(r["cluster_file"]).parent.name == "clusters"
        )
    unknown = CliRunner().invoke(main, ["predict", "jobs/laptop.toml", "--cluster", "a100"])
    assert unknown.exit_code == 2
    assert unknown.output.strip().splitlines() == [
        "mpihybrid: error: unknown cluster 'a100': give a file or one of "
        "a100_40gb, a100_80gb, local"
    ]


def test_the_users_calibrated_file_comes_before_the_packaged_one(tmp_path, monkeypatch):
    from mpihybrid.predict.cluster import find_cluster, package_dir

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert find_cluster("local") == package_dir() / "local.toml"
    mine = tmp_path / "mpihybrid" / "clusters" / "local.toml"
    mine.parent.mkdir(parents=True)
    mine.write_text(LOCAL.read_text())
    assert find_cluster("local") == mine


def test_a_job_that_does_not_fit_exits_4_after_its_prediction():
    args = ["predict", "jobs/a100_gpt.toml", "--cluster", "a100_40gb",
            "--set", "model.hidden=12288", "--set", "model.depth=48"]  # fmt: skip
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(main, [*args, *extra])
        assert result.exit_code == 4, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mpihybrid: error: does not fit: rank ")
        assert "the device has 37.25 GiB" in lines[0]
        if extra:
            assert not json.loads(result.stdout)["memory"][0]["fits"]
        else:
            assert "DOES NOT FIT" in result.stdout


def test_calibration_workers_run_one_blas_thread_each():
    from mpihybrid._threads import THREAD_VARS
    from mpihybrid.predict.microbench import _worker_env

    env = _worker_env()
    assert all(env[name] == "1" for name in THREAD_VARS)
    assert not any(k.startswith(("PMI", "HYDRA")) for k in env)


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    trace = tmp_path_factory.mktemp("cal") / "cal.h5"
    sets = ["model.hidden=64", "data.features=32", "train.steps=3", "train.global_batch=64"]
    proc = run_mpi(2, "-m", "mpihybrid", "train", "jobs/bench_pp2.toml", "--quiet",
                   *[a for s in sets for a in ("--set", s)], "--trace", str(trace))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return trace


@pytest.mark.mpi
def test_calibrate_says_what_it_fitted_and_wrote_and_overwrites_nothing(
    small_trace, tmp_path, monkeypatch
):
    """Every fitted figure and the path on stdout; a new file in the user's directory; an
    existing one is left alone (exit 2) unless --cluster-out names it. The micro-benchmarks
    are replaced by fixed rates (their timing is not this test's)."""
    import mpihybrid.predict.calibrate as calibrate
    from mpihybrid.predict.cluster import CodecRate

    seen = []

    def fixed(workers):
        seen.append(workers)
        return {"workers": workers, "gemm": [gemm_seconds(g, load_cluster(LOCAL).device)
                                             for g in GEMM_SHAPES],
                "codecs": {c: CodecRate(1e10, 1e10) for c in load_cluster(LOCAL).codecs},
                "copy": 1e10}  # fmt: skip

    monkeypatch.setattr(calibrate, "loaded_rates", fixed)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    mine = tmp_path / "mpihybrid" / "clusters" / "local.toml"
    args = ["predict", "jobs/bench_pp2.toml", "--calibrate", str(small_trace)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert seen == [2]  # the trace's two ranks, both cores busy
    assert f"wrote {mine}" in result.output and "device.gemm_flops = " in result.output
    assert "links.node.alpha_s = " in result.output
    fitted = load_cluster(mine)
    assert fitted.device.gemm_flops == pytest.approx(load_cluster(LOCAL).device.gemm_flops, 1e-3)
    before = mine.read_bytes()
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "--cluster-out" in again.output
    assert mine.read_bytes() == before
    other = tmp_path / "other.toml"
    other.write_text("keep me")
    asked = CliRunner().invoke(main, [*args, "--cluster-out", str(other), "--json"])
    assert asked.exit_code == 0, asked.output
    assert json.loads(asked.stdout)["cluster_file"] == str(other)
    assert f"wrote {other}" in asked.stderr and load_cluster(other).name == "local"


@pytest.mark.parametrize(
    "path, sets",
    [
        ("jobs/gpt_bench.toml", ["train.microbatches=2"]),
        ("jobs/gpt_bench.toml", ["train.schedule=zb-h1", "train.global_batch=4"]),
        ("jobs/laptop.toml", ["train.global_batch=64"]),
        ("jobs/bench_pp2.toml", ["train.schedule=interleaved-1f1b", "train.virtual_stages=2"]),
        ("jobs/bench_pp2.toml", ["model.norm=true", "model.activation=gelu", "model.hidden=64"]),
    ],
)
def test_activation_bytes_equal_the_runtime_count(path, sets):
    """The layers' declared kept bytes (Layer.cost) add up to what the runtime counts on a real
    forward of each stage."""
    job = _job(path, *sets)
    in_features, num_classes = task_dims(job.data)
    chunks = job.grid.pp * job.train.virtual_stages
    samples = job.train.global_batch // (job.grid.dp * job.train.microbatches)
    x = (
        np.random.default_rng(0).integers(0, num_classes, (samples, in_features))
        if job.model.kind == "gpt"
        else np.random.default_rng(0).standard_normal((samples, in_features), np.float32)
    )
    work = stage_work(job.workload)
    for c in range(chunks):
        stage = build_stage(job.model, in_features, num_classes, c, chunks, seed=0)
        x, cache = stage.forward(x)
        print(c, stage.activation_nbytes(cache), work[c].activation_bytes)
        assert stage.activation_nbytes(cache) == work[c].activation_bytes


@pytest.mark.parametrize(
    "path, sets",
    [
        ("jobs/gpt_bench.toml", []),
        ("jobs/bench_pp2.toml", ["model.norm=true", "model.activation=gelu"]),
        ("jobs/bench_pp2.toml", ["train.schedule=interleaved-1f1b", "train.virtual_stages=2"]),
    ],
)
def test_one_declaration_of_gemms_for_predict_bench_and_partition(path, sets):
    """bench train's roofline runs the GEMMs the layers declare (Layer.cost), predict times the
    same per chunk, and the partition's per-row estimate (Layer.flops) agrees."""
    from mpihybrid.cli.bench_train import chunk_gemm_flops, gemm_flops, model_gemms
    from mpihybrid.nn.cost import microbatch_rows
    from mpihybrid.nn.model import block_costs, build_blocks

    job = _job(path, *sets)
    rows = microbatch_rows(job.workload)[1]
    per_chunk = chunk_gemm_flops(job)
    assert per_chunk == [sum(w.flops(k) for k in "FBW") for w in stage_work(job.workload)]
    assert gemm_flops(model_gemms(job.workload)) == sum(per_chunk)
    assert sum(block_costs(build_blocks(job.model, *task_dims(job.data)))) * rows == sum(per_chunk)


def test_declared_gemms_of_a_transformer_layer_by_hand():
    """One GPT layer on b = 2 sequences of T = 8 tokens, C = 16, h = 2 (d = 8), F = 64."""
    from mpihybrid.nn.layers import layer_costs
    from mpihybrid.nn.model import build_blocks

    job = _job("jobs/gpt_bench.toml", "model.hidden=16", "model.heads=2", "model.ffn=64",
               "data.seq_len=8")  # fmt: skip
    attention, mlp = build_blocks(job.model, 8, 50)[1]
    r = 2 * 8
    a, t, d = 2 * 2, 8, 8
    att, ffn = layer_costs([attention, mlp], r, 16)
    assert att.gemms["F"] == [(1, r, 16, 48), (a, t, d, t), (a, t, t, d), (1, r, 16, 16)]
    assert att.gemms["B"] == [(1, r, 48, 16), (a, t, t, d), (a, t, d, t), (a, t, t, d),
                              (a, t, t, d), (1, r, 16, 16)]  # fmt: skip
    assert att.gemms["W"] == [(1, 16, r, 48), (1, 16, r, 16)]
    assert ffn.gemms["F"] == [(1, r, 16, 64), (1, r, 64, 16)]
    # kept: LayerNorm's xhat and rstd; the Linears' inputs; attention's qkv and probabilities
    assert att.kept_bytes == 4 * (r * 16 + r) + 4 * r * 16 + 4 * (r * 48 + a * t * t) + 4 * r * 16
    assert ffn.kept_bytes == 4 * (r * 16 + r) + 4 * r * 16 + 2 * 4 * r * 64 + 4 * r * 64


def test_the_check_before_a_run_and_predict_share_one_memory_model():
    """train.memory.rank_estimate (the check before a run) gives predict's parts per rank."""
    from mpihybrid.train.memory import rank_estimate

    for path, sets in [("jobs/gpt_bench.toml", ["train.schedule=zb-h1"]),
                       ("jobs/bench_pp2.toml", ["grid.dp=2", "comm.codec=int8"])]:  # fmt: skip
        job = _job(path, *sets)
        cluster = load_cluster(LOCAL)  # every rank on one node: a lossy ring's wire is shared
        cluster = dataclasses.replace(
            cluster, node=dataclasses.replace(cluster.node, ranks_per_node=8)
        )
        r = predict(job, cluster)
        for pp_rank, m in enumerate(r["memory"]):
            parts = {k: v for k, v in m["parts"].items() if k != "runtime"}
            assert rank_estimate(job, pp_rank, ring_shared=True) == parts
            assert sum(parts.values()) + m["base_bytes"] == m["total_bytes"]


def test_gemm_fit_recovers_the_rates_it_was_made_from():
    """fit_gemm on times made by the model itself gives back its three figures."""
    device = load_cluster(A100).device
    device = dataclasses.replace(device, gemm_flops=80e9, gemm_bandwidth=9e9, gemm_call_s=2e-6)
    times = [(shape, gemm_seconds(shape, device)) for shape in GEMM_SHAPES]
    flops, bandwidth, call = fit_gemm(times)
    assert flops == pytest.approx(80e9, rel=1e-6) and bandwidth == pytest.approx(9e9, rel=1e-6)
    assert call == pytest.approx(2e-6, rel=1e-6)


def test_buckets_overlap_as_the_runtime_runs_them():
    """pp = 1 x dp = 2 on two nodes of one rank (the ring crosses the network): with
    comm.overlap = off every bucket waits for the pipeline; poll reduces the buckets between the
    backward's layers on the rank's own core, so the step is as long but less of it is exposed;
    a communication thread (thread) leaves only the ring's own work on that core."""
    cluster = load_cluster(A100)
    cpu = {"gemm_flops": 80e9, "mem_bandwidth": 15e9, "host_copy_bandwidth": 0.0}  # one core
    cluster = dataclasses.replace(
        cluster,
        node=dataclasses.replace(cluster.node, ranks_per_node=1),
        device=dataclasses.replace(cluster.device, **cpu),
        links={**cluster.links, "network": Link(1e-4, 2.5e8, 2.5e8)},
    )
    sets = ["grid.pp=1", "grid.dp=2", "train.global_batch=1024", "comm.bucket_kb=1024"]
    r = {o: predict(_job("jobs/bench_pp2.toml", *sets, f"comm.overlap={o}"), cluster)
         for o in ("off", "poll", "thread")}  # fmt: skip
    assert r["poll"]["step_time_s"] == pytest.approx(r["off"]["step_time_s"], rel=1e-9)
    assert r["poll"]["exposed_comm_s"] < r["off"]["exposed_comm_s"] / 4
    assert r["thread"]["step_time_s"] < r["poll"]["step_time_s"] - 0.5 * r["poll"]["exposed_comm_s"]


def test_peak_rss_starts_over_after_a_reset():
    """What bench train compares with the prediction: the steps' own peak, not what came before
    (an earlier repeat's roofline pass) -- VmHWM started over by reset_peak_rss."""
    block = np.ones(64 << 20, np.uint8)  # 64 MiB, touched
    del block
    before = peak_rss_bytes()
    if not reset_peak_rss():
        pytest.skip("this kernel cannot reset the peak resident set (/proc/self/clear_refs)")
    assert peak_rss_bytes() < before - (48 << 20)


def test_placement_decides_whether_the_ring_crosses_nodes():
    """pp=2 x dp=4 on nodes of 4: data-inner keeps each ring in a node, pipeline-inner sends it
    over the network; int8 pays off only where the ring is on the slow link."""
    cluster = load_cluster(A100)
    cluster = dataclasses.replace(
        cluster,
        node=dataclasses.replace(cluster.node, ranks_per_node=4),
        links={**cluster.links, "network": Link(1e-4, 2.5e8, 2.5e8)},  # 2 Gbit/s
    )
    times = {}
    for order in ("data-inner", "pipeline-inner"):
        for codec in ("fp32", "int8"):
            job = _job(
                "jobs/laptop.toml", "grid.dp=4", f"grid.order={order}", f"comm.codec={codec}"
            )
            times[order, codec] = ring_seconds(job, 0, 10_000_000, cluster)[0]
    assert times["data-inner", "fp32"] < times["pipeline-inner", "fp32"] / 10
    assert times["pipeline-inner", "int8"] < times["pipeline-inner", "fp32"] / 2
    assert times["data-inner", "int8"] > times["data-inner", "fp32"]


def test_predict_every_job_file_json():
    for path in sorted((ROOT / "jobs").glob("*.toml")):
        result = CliRunner().invoke(main, ["predict", str(path), "--cluster", str(A100), "--json"])
        assert result.exit_code == 0, (path, result.output)
        r = json.loads(result.output)
        assert r["step_time_s"] > r["pipeline_s"] > 0 and 0 <= r["bubble"] < 1, path
        assert len(r["memory"]) == r["job"]["pp"] and r["throughput"] > 0, path


def test_a100_gpt_fits_and_1f1b_holds_fewer_activations_than_gpipe():
    cluster = load_cluster(A100)
    one = predict(_job("jobs/a100_gpt.toml"), cluster)
    gpipe = predict(_job("jobs/a100_gpt.toml", "train.schedule=gpipe"), cluster)
    assert one["memory"][0]["fits"] and one["peak_memory_bytes"] < 80e9
    # 1F1B keeps pp = 4 micro-batches alive on stage 0, GPipe all 8
    assert gpipe["memory"][0]["activation_bytes"] == 2 * one["memory"][0]["activation_bytes"]


# ---------------------------------------------------------------------------------------------
# the model's mechanics on made-up figures (exact expectations; accuracy against timed runs is
# benchmarks/predict_validation.py's, never a test's)


def _plain(cluster, **device):
    """`cluster` with round device figures: no GEMM operand traffic, no per-call costs."""
    d = {"gemm_flops": 1e9, "gemm_bandwidth": 0.0, "gemm_call_s": 0.0, "mem_bandwidth": 1e9,
         "optimizer_bandwidth": 1e9, "op_overhead_s": 0.0, "step_overhead_s": 0.0,
         "host_copy_bandwidth": 0.0, **device}  # fmt: skip
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **d))


@pytest.mark.parametrize("microbatches", [1, 4])
def test_one_rank_step_is_the_sum_of_its_parts(microbatches):
    """pp = dp = 1: M x (F + B + W) + the optimizer + the step's own work, nothing else."""
    from mpihybrid.predict.model import action_seconds, optimizer_seconds, step_work_seconds

    cluster = _plain(load_cluster(A100), op_overhead_s=1e-5, step_overhead_s=1e-3)
    sets = ["grid.pp=1", "grid.dp=1", f"train.microbatches={microbatches}"]
    job = _job("jobs/bench_pp2.toml", *sets)
    (work,) = stage_work(job.workload)
    r = predict(job, cluster)
    compute = sum(action_seconds(work, k, cluster) for k in "FBW") * microbatches
    rest = optimizer_seconds(job, work.params, cluster) + step_work_seconds(
        job, work.params, cluster
    )
    assert r["pipeline_s"] == pytest.approx(compute, rel=1e-12)
    assert r["step_time_s"] == pytest.approx(compute + rest, rel=1e-12)
    assert r["bubble"] == pytest.approx(0.0, abs=1e-12)


def test_gemm_and_elementwise_seconds_by_hand():
    """A Linear(512, 256)'s forward on 64 rows: 2 x 64 x 512 x 256 FLOPs, 4 x (64 x 512 +
    512 x 256 + 64 x 256) operand bytes, one call; its bias add 8 x 64 x 256 bytes."""
    from mpihybrid.nn.layers import Cost
    from mpihybrid.predict.model import layer_seconds

    device = _plain(load_cluster(A100), gemm_bandwidth=2e9, gemm_call_s=1e-6,
                    op_overhead_s=1e-5).device  # fmt: skip
    layer = Cost(params=512 * 256 + 256)
    layer.gemms["F"].append((1, 64, 512, 256))
    layer.elem_bytes["F"] = 8 * 64 * 256
    layer.calls["F"] = 1
    flops, operands = 2 * 64 * 512 * 256, 4 * (64 * 512 + 512 * 256 + 64 * 256)
    expected = flops / 1e9 + operands / 2e9 + 1e-6 + 8 * 64 * 256 / 1e9 + 1e-5
    assert layer_seconds(layer, "F", device) == pytest.approx(expected, rel=1e-12)


def test_ring_seconds_by_hand():
    """An fp32 ring of dp = 2 over the network (one rank per node): 2(p - 1) hops of half the
    gradient in messages of comm.segment_kb, the received halves added, the mean."""
    cluster = _plain(load_cluster(A100), mem_bandwidth=4e9)
    cluster = dataclasses.replace(
        cluster,
        node=dataclasses.replace(cluster.node, ranks_per_node=1),
        links={**cluster.links, "network": Link(1e-4, 2.5e8, 0.0)},
        codecs={**cluster.codecs, "fp32": dataclasses.replace(cluster.codecs["fp32"], decode=8e9)},
    )
    job = _job("jobs/laptop.toml", "grid.pp=1", "grid.dp=2", "comm.codec=fp32")
    params = 1_000_000
    half = params // 2
    messages = -(-half // (job.comm.segment_kb * 256))
    hop = messages * 1e-4 + 4 * half / 2.5e8
    work = 4 * half / 8e9 + 2 * 4 * params / 4e9
    seconds, own = ring_seconds(job, 0, params, cluster)
    assert seconds == pytest.approx(2 * hop + work, rel=1e-12)
    assert own == pytest.approx(work, rel=1e-12)  # the wire is the network's, not the core's


@pytest.mark.parametrize(
    "codec, param_codec", [("fp32", "int8"), ("int8", "fp32"), ("fp32", "bf16")]
)
def test_a_sharded_ring_gathers_the_weights_in_param_codec(codec, param_codec):
    """train.shard_optimizer: the reduce-scatter hops carry the gradient's codec, the weight
    all-gather's hops comm.param_codec's bytes (dp = 2 over the network, by hand): the owner
    encodes its chunk once and every replica, the owner too, decodes it; the mean is of the
    owned half alone."""
    from mpihybrid.comm.codecs import get_codec

    cluster = _plain(load_cluster(A100), mem_bandwidth=4e9)
    cluster = dataclasses.replace(
        cluster,
        node=dataclasses.replace(cluster.node, ranks_per_node=1),
        links={**cluster.links, "network": Link(1e-4, 2.5e8, 0.0)},
    )
    sets = ["grid.pp=1", "grid.dp=2", f"comm.codec={codec}", "train.shard_optimizer=true",
            f"comm.param_codec={param_codec}"]  # fmt: skip
    job = _job("jobs/laptop.toml", *sets)
    params = 1_000_000
    half = params // 2
    messages = -(-half // (job.comm.segment_kb * 256))

    def hop(name: str) -> float:
        return messages * 1e-4 + get_codec(name, job.comm.block).nbytes(half) / 2.5e8

    rs, ag = cluster.codecs[codec], cluster.codecs[param_codec]
    rs_work = 4 * half * ((1 / rs.encode if codec != "fp32" else 0) + 1 / rs.decode)
    rs_work += 2 * 4 * half / 4e9  # the owned half's mean
    ag_work = 4 * half / ag.encode + 2 * 4 * half / ag.decode if param_codec != "fp32" else 0
    seconds, own = ring_seconds(job, 0, params, cluster)
    assert seconds == pytest.approx(hop(codec) + hop(param_codec) + rs_work + ag_work, rel=1e-12)
    assert own == pytest.approx(rs_work + ag_work, rel=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "sets",
    [
        ["train.schedule=gpipe", "train.microbatches=4", "train.global_batch=64"],
        ["train.schedule=zb-h1", "train.microbatches=2", "train.global_batch=32"],
    ],
)
def test_activation_peaks_equal_what_the_runtime_counts(sets):
    """The liveness rule's peak per stage is what bench train counts on the ranks (a count of
    bytes, not a time)."""
    tiny = ["model.hidden=64", "data.features=32", "train.steps=2"]
    args = [a for s in tiny + sets for a in ("--set", s)]
    proc = run_mpi(2, "-m", "mpihybrid", "bench", "train", "jobs/bench_pp2.toml", *args,
                   "--warmup", "1", "--steps", "1", "--repeats", "1", "--json",
                   timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = [s["peak_activation_bytes"] for s in json.loads(proc.stdout)["stages"]]
    predicted = predict(_job("jobs/bench_pp2.toml", *tiny, *sets), load_cluster(A100))
    per_stage = {int(s): b for m in predicted["memory"] for s, b in
                 m["activation_bytes_per_stage"].items()}  # fmt: skip
    assert measured == [per_stage[s] for s in range(len(measured))]


def test_local_cluster_file_says_how_it_was_made():
    assert "--calibrate" in Path(LOCAL).read_text()


# ---------------------------------------------------------------------------------------------
# the recommender


def _search(*args: str):
    return CliRunner().invoke(main, ["predict", *args, "--search", "--json"])


def test_search_ranks_fitting_layouts_best_first_and_their_sets_make_them():
    """World 4 for the GPT benchmark: every pp x dp, both orders, every schedule, codecs and
    buckets; best first; each entry's --set strings give back its prediction exactly."""
    from mpihybrid.pipeline.schedules import SCHEDULES

    result = _search("jobs/gpt_bench.toml", "--world", "4", "--cluster", str(LOCAL))
    assert result.exit_code == 0, result.output
    ranked = json.loads(result.stdout)
    throughputs = [e["throughput"] for e in ranked]
    assert throughputs == sorted(throughputs, reverse=True) and len(ranked) > 100
    sets = [dict(s.split("=") for s in e["set"]) for e in ranked]
    assert {(s["grid.pp"], s["grid.dp"]) for s in sets} == {("1", "4"), ("2", "2"), ("4", "1")}
    assert {s["grid.order"] for s in sets if s["grid.dp"] == "2"} == {"pipeline-inner",
                                                                      "data-inner"}  # fmt: skip
    assert {s["train.schedule"] for s in sets if s["grid.pp"] != "1"} == set(SCHEDULES)
    assert {s["comm.codec"] for s in sets} == {"fp32", "fp16", "bf16", "int8"}
    assert len({s["comm.bucket_kb"] for s in sets}) >= 4
    assert ranked[0]["reason"].startswith("best:") and all(e["reason"] for e in ranked)
    cluster = load_cluster(LOCAL)
    for entry in (ranked[0], ranked[len(ranked) // 2], ranked[-1]):
        again = predict(_job("jobs/gpt_bench.toml", *entry["set"]), cluster)
        assert again["throughput"] == pytest.approx(entry["throughput"], rel=1e-12)


def test_search_keeps_only_layouts_that_fit(tmp_path):
    """A device of 700 MiB: the GPT's layouts that need more are left out, the rest kept."""
    table = _table()
    table["node"]["memory_bytes"] = 700 * 2**20
    small = tmp_path / "small.toml"
    small.write_text(_toml(table))
    everything = json.loads(_search("jobs/gpt_bench.toml", "--cluster", str(A100)).stdout)
    result = _search("jobs/gpt_bench.toml", "--cluster", str(small))
    assert result.exit_code == 0, result.output
    kept = json.loads(result.stdout)
    assert 0 < len(kept) < len(everything)
    assert all(e["peak_memory_bytes"] <= 700 * 2**20 for e in kept)
    assert {tuple(e["set"]) for e in kept} == {
        tuple(e["set"]) for e in everything if e["peak_memory_bytes"] <= 700 * 2**20
    }


def test_search_with_no_layout_that_fits_exits_4_and_none_to_make_exits_2(tmp_path):
    table = _table()
    table["node"]["memory_bytes"] = 2**20
    tiny = tmp_path / "tiny.toml"
    tiny.write_text(_toml(table))
    result = _search("jobs/gpt_bench.toml", "--cluster", str(tiny))
    assert result.exit_code == 4 and json.loads(result.stdout) == []
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpihybrid: error: does not fit: none of the ")
    # 7 ranks: 8 sequences split over no dp of 7, and 6 blocks over no pipeline of 7
    made = _search("jobs/gpt_bench.toml", "--world", "7", "--cluster", str(A100))
    assert made.exit_code == 2
    assert made.output.strip().splitlines() == [
        "mpihybrid: error: no layout of this job on 7 ranks: every pp x dp, schedule and M was "
        "refused (see `mpihybrid train` for the rule)"
    ]


def test_more_ranks_than_cores_share_them():
    """node.cores: 4 ranks on 2 cores run at half the rates; 2 ranks on 2 cores as given."""
    from mpihybrid.predict.cluster import shared_cores

    local = load_cluster(LOCAL)
    one = dataclasses.replace(local, node=dataclasses.replace(local.node, ranks_per_node=4))
    assert shared_cores(one, 2) == one
    shared = shared_cores(one, 4)
    assert shared.device.gemm_flops == local.device.gemm_flops / 2
    assert shared.codecs["int8"].encode == local.codecs["int8"].encode / 2
    assert shared_cores(shared, 4) == shared  # applied once


def test_the_compiled_kernels_runtime_counts_only_for_jobs_that_run_them():
    """kernel_memory_bytes joins a rank's runtime when its job runs a numba kernel (a GPT, GELU,
    LayerNorm, AdamW, a lossy ring), not for a ReLU MLP with SGD and an fp32 ring."""
    from mpihybrid import _numba
    from mpihybrid.predict.model import runs_compiled_kernels

    local = load_cluster(LOCAL)
    cluster = dataclasses.replace(
        local, device=dataclasses.replace(local.device, kernel_memory_bytes=48 << 20)
    )
    plain = _job("jobs/bench_pp2.toml", "grid.pp=1", "grid.dp=2")
    for job, runs in [(plain, False), (_job("jobs/bench_pp2.toml", "grid.pp=1", "grid.dp=2",
                      "comm.codec=int8"), True), (_job("jobs/gpt_bench.toml"), True),
                      (_job("jobs/bench_pp2.toml", "model.activation=gelu"), True)]:  # fmt: skip
        assert runs_compiled_kernels(job) == (runs and _numba.ENABLED)
        extra = predict(job, cluster)["memory"][0]["base_bytes"] - local.device.base_memory_bytes
        assert extra == (48 << 20 if runs and _numba.ENABLED else 0)
