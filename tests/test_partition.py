"""model.partition = "timed" and the split balanced by pp rank (nn.model.balanced_for_ranks,
train/partition.py): which blocks land where, the list form's empty ends, a resume keeping its
checkpoint's split, and a timed run under mpiexec (the trace keeps the list it ran)."""

from __future__ import annotations

import itertools

import pytest

from mpihybrid.config import ConfigError, load_job
from mpihybrid.nn.model import (
    balanced_for_ranks,
    build_blocks,
    check_counts,
    chunk_ranges,
    layer_counts,
    partition,
)
from mpihybrid.train import partition as timed
from tests.helpers import run_mpi

GPT = ["model.kind=gpt", "data.kind=random-tokens", "model.depth=4", "model.hidden=16",
       "model.heads=2", "model.ffn=32", "data.vocab=50", "data.seq_len=8", "grid.pp=2",
       "grid.dp=1", "train.global_batch=8", "train.microbatches=4"]  # fmt: skip
V = ["train.schedule=zb-v", "train.virtual_stages=2"]


def _loads(costs, ranges, rank_of):
    loads = {}
    for r, chunk in zip(rank_of, ranges, strict=True):
        loads[r] = loads.get(r, 0) + sum(costs[i] for i in chunk)
    return loads


def test_one_chunk_per_rank_is_partitions_answer():
    for costs in ([5, 1, 1, 1, 1, 9], [3, 3, 3, 3], [1, 2, 3, 4, 5, 6, 7]):
        for k in range(1, len(costs) + 1):
            assert balanced_for_ranks(costs, list(range(k))) == partition(costs, k), (costs, k)


def test_a_v_balances_the_ranks_not_the_chunks():
    costs = [1, 4, 4, 4, 4, 8]  # embedding, four layers, a head of two layers
    rank_of = [0, 1, 1, 0]  # the V of two ranks
    ranges = balanced_for_ranks(costs, rank_of)
    best = min(
        max(_loads(costs, [range(a, b) for a, b in itertools.pairwise((0, *cuts, 6))],
                   rank_of).values())
        for cuts in itertools.combinations(range(1, 6), 3)
    )  # fmt: skip
    assert max(_loads(costs, ranges, rank_of).values()) == best == 13
    by_chunks = partition(costs, 4)
    assert max(_loads(costs, by_chunks, rank_of).values()) >= best


def test_empty_ends_are_the_embedding_or_the_head_alone():
    job = load_job(None, [*GPT, *V, "model.partition=[0, 2, 1, 1]"], 2)
    blocks = build_blocks(job.model, 8, 50)
    ranges = chunk_ranges(job.model, blocks, 4)
    assert ranges == [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]
    assert layer_counts(job.model, ranges) == [0, 2, 1, 1]
    job = load_job(None, [*GPT, "model.partition=[4, 0]"], 2)
    assert chunk_ranges(job.model, blocks, 2) == [range(0, 5), range(5, 6)]
    with pytest.raises(ValueError, match="integer >= 1"):  # an MLP has no embedding to stand alone
        check_counts([0, 4], 4, 2)
    with pytest.raises(ConfigError, match=r"\[1, 0, 2, 1\]: every count must be an integer >= 1"):
        load_job(None, [*GPT, *V, "model.partition=[1, 0, 2, 1]"], 2)  # a middle chunk empty


def test_timed_is_resolved_before_anything_builds(monkeypatch):
    job = load_job(None, [*GPT, *V, 'model.partition="timed"'], 2)
    with pytest.raises(ValueError, match="resolve the job first"):
        chunk_ranges(job.model, build_blocks(job.model, 8, 50), 4)
    costs = [0.1, 2.0, 2.0, 2.0, 2.0, 4.5]  # a measurement, as timed_block_costs returns it
    monkeypatch.setattr(timed, "timed_block_costs", lambda job, repeats: costs)
    resolved = timed.resolve_partition(job)
    counts = resolved.model.partition
    assert isinstance(counts, list) and sum(counts) == 4 and len(counts) == 4
    ranges = chunk_ranges(resolved.model, build_blocks(job.model, 8, 50), 4)
    assert max(_loads(costs, ranges, [0, 1, 1, 0]).values()) == pytest.approx(6.6)
    loop = timed.resolve_partition(load_job(None, [*GPT, 'model.partition="timed"'], 2))
    assert loop.model.partition == layer_counts(job.model, partition(costs, 2))


def test_a_resume_keeps_its_checkpoints_split(monkeypatch, tmp_path):
    job = load_job(None, [*GPT, *V, 'model.partition="timed"', f'checkpoint.dir="{tmp_path}"'], 2)
    manifest = {"job": "[model]\npartition = [1, 1, 2, 0]\n"}
    monkeypatch.setattr("mpihybrid.train.checkpoint.latest", lambda root: tmp_path)
    monkeypatch.setattr("mpihybrid.train.checkpoint.read_manifest", lambda path: manifest)

    def never(*args):
        raise AssertionError("a resume must not time the blocks again")

    monkeypatch.setattr(timed, "timed_block_costs", never)
    assert timed.resolve_partition(job).model.partition == [1, 1, 2, 0]


@pytest.mark.mpi
def test_a_timed_run_trains_and_keeps_its_split(tmp_path):
    trace = tmp_path / "t.h5"
    sets = [*GPT, *V, 'model.partition="timed"', "train.steps=2", 'checkpoint.dir=""']
    argv = ["-m", "mpihybrid", "train", "--quiet", "--trace", str(trace)]
    for s in sets:
        argv += ["--set", s]
    proc = run_mpi(2, *argv, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from mpihybrid.config import tomllib
    from mpihybrid.trace.read import load

    counts = tomllib.loads(load(trace).config)["model"]["partition"]
    assert isinstance(counts, list) and len(counts) == 4 and sum(counts) == 4, counts


def test_search_refuses_a_timed_partition():
    import subprocess
    import sys

    from tests.helpers import ROOT, mpi_env

    proc = subprocess.run(
        [sys.executable, "-m", "mpihybrid", "predict", str(ROOT / "jobs" / "gpt_bench.toml"),
         "--set", 'model.partition="timed"', "--search"],
        capture_output=True, text=True, env=mpi_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "mpihybrid: error: model.partition = 'timed' times one layout and --search varies them: "
        "search with 'cost', then time the layout chosen"
    ]
