"""Job files, --set overrides and validation (pure logic, no MPI)."""

from __future__ import annotations

import pytest

from mpihybrid.config import (
    ConfigError,
    build_job,
    load_job,
    load_table,
    parse_override,
    to_toml,
)

JOBS = ["jobs/seed_k3_d4.toml", "jobs/laptop.toml"]


def test_override_parsing():
    assert parse_override("train.steps=20") == ("train", "steps", 20)
    assert parse_override("train.lr=1e-3") == ("train", "lr", 1e-3)
    assert parse_override("train.schedule=gpipe") == ("train", "schedule", "gpipe")
    assert parse_override('trace.path="a b.h5"') == ("trace", "path", "a b.h5")
    assert parse_override("comm.error_feedback=false") == ("comm", "error_feedback", False)
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("steps=20")


def test_command_line_beats_file_beats_defaults():
    job = load_job("jobs/seed_k3_d4.toml", ["train.steps=7", "comm.codec=fp16"], 12)
    assert job.train.steps == 7 and job.comm.codec == "fp16"  # command line
    assert job.grid.pp == 3 and job.train.microbatches == 6  # file
    assert job.train.weight_decay == 0.0  # default


@pytest.mark.parametrize("path", JOBS)
def test_shipped_jobs_load(path):
    table = load_table(path)
    world = table["grid"]["pp"] * table["grid"]["dp"]
    job = load_job(path, [], world)
    assert job.grid.pp * job.grid.dp == world


@pytest.mark.parametrize("world", range(1, 13))
def test_default_job_runs_on_any_world_size(world):
    job = load_job(None, [], world)
    assert job.grid.pp * job.grid.dp == world
    assert job.grid.pp == (2 if world % 2 == 0 else 1)


def test_dp_minus_one_takes_the_leftover_ranks():
    job = load_job(None, ["grid.pp=2", "grid.dp=-1", "train.global_batch=48"], 6)
    assert job.grid.dp == 3


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["grid.pp=4", "grid.dp=3"], 8, r"pp\(4\) \* dp\(3\) = 12 != world size 8"),
        (["train.global_batch=100"], 4, r"global_batch\(100\) is not divisible by dp\(2\)"),
        (["train.schedule=pipedream"], 4, "train.schedule = 'pipedream': unknown"),
        (["comm.codec=int4"], 4, "comm.codec = 'int4': unknown"),
        (["model.kind=resnet"], 4, "model.kind = 'resnet': unknown"),
        (["train.optimizer=lion"], 4, "train.optimizer = 'lion': unknown"),
        (["train.steps=ten"], 4, "train.steps = 'ten': expected int, got str"),
        (["train.stepz=10"], 4, "unknown key train.stepz"),
        (["gird.pp=1"], 4, "unknown section 'gird'"),
        (["comm.sync_sends=1"], 4, "expected bool, got int"),
        (["model.depth=1"], 4, r"model.depth\(1\) < pp\(2\)"),
        (["grid.pp=3", "grid.dp=-1"], 4, "divisible by pp"),
    ],
)
def test_bad_input_names_the_rule(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        load_job(None, overrides, world)


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job(bad, [], 1)
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(tmp_path / "missing.toml", [], 1)


def test_resolved_job_round_trips_through_toml():
    job = load_job("jobs/seed_k3_d4.toml", ['trace.path="x.h5"'], 12)
    import tomllib

    again = build_job(tomllib.loads(to_toml(job)))
    assert again == job


def test_default_batch_divides_on_any_world_size():
    for world in range(1, 13):
        job = load_job(None, [], world)
        assert job.train.global_batch % (job.grid.dp * job.train.microbatches) == 0


def test_default_job_leaves_dp_free():
    """--set grid.pp=1 alone works with the embedded job: dp is not pinned to its pp=2 split."""
    job = load_job(None, ["grid.pp=1"], 2)
    assert (job.grid.pp, job.grid.dp) == (1, 2)
    assert job.train.global_batch % (2 * job.train.microbatches) == 0


def test_empty_job_file_is_the_embedded_job(tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    for world in (1, 2, 3, 4):
        assert load_job(empty, [], world) == load_job(None, [], world)


def test_job_file_that_is_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_job(tmp_path, [], 1)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=nan", "train.lr = nan: must be a finite number"),
        ("train.lr=inf", "train.lr = inf: must be a finite number"),
        ("train.lr=-inf", "train.lr = -inf: must be a finite number"),
        ("train.weight_decay=nan", "train.weight_decay = nan: must be a finite"),
        ("train.betas=[0.9, nan]", "train.betas = \\[0.9, nan\\]: must be a finite"),
        ("train.momentum=-5", r"train.momentum = -5.0: must be in \[0, 1\)"),
        ("train.momentum=1", r"train.momentum = 1.0: must be in \[0, 1\)"),
        ("train.weight_decay=-0.1", r"train.weight_decay = -0.1: must be in \[0, 1\)"),
        ("train.betas=[0.9, 1.0]", r"train.betas\[1\] = 1.0: must be in \[0, 1\)"),
        ("train.betas=[-0.1, 0.99]", r"train.betas\[0\] = -0.1: must be in \[0, 1\)"),
        ("train.betas=[0.9]", "expected two numbers"),
    ],
)
def test_optimizer_settings_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        load_job(None, ["train.optimizer=adamw", override], 2)
