"""Only regular files are read where a user names a path (mpihybrid/inputs.py): a FIFO, a device
or a directory is one line and exit 2 before any open that could block, and each reader's bound
is named when a file is over it. Every FIFO here is real (os.mkfifo) and every command runs in a
subprocess with a timeout, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpihybrid.inputs import (
    MAX_TOML_BYTES,
    InputFileError,
    InputTooLargeError,
    NotRegularFileError,
    read_regular,
)
from mpihybrid.nn.tokens import write_tokens
from tests.helpers import ROOT, mpi_env, run_mpi

TIMEOUT = 60  # seconds: a command blocked on a FIFO fails the test instead of hanging it


def fifo(path):
    os.mkfifo(path)
    return path


def mpihybrid(*args, cwd=None):
    """`python -m mpihybrid ARGS` in one process (no mpiexec)."""
    return subprocess.run([sys.executable, "-m", "mpihybrid", *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=mpi_env(),
                          cwd=cwd or ROOT)  # fmt: skip


def one_error_line(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mpihybrid: error:"), lines[0]
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("kind", ["fifo", "dir", "device", "missing"])
def test_read_regular_refuses_what_is_not_a_regular_file(tmp_path, kind):
    made = {"fifo": lambda: fifo(tmp_path / "p"), "dir": lambda: tmp_path,
            "device": lambda: "/dev/zero", "missing": lambda: tmp_path / "gone"}  # fmt: skip
    path = made[kind]()
    with pytest.raises(NotRegularFileError) as err:
        read_regular(path, what="job file", limit=1024)
    words = {"fifo": "is a FIFO", "dir": "is a directory", "device": "is a character device",
             "missing": "no such file"}[kind]  # fmt: skip
    assert words in str(err.value) and "\n" not in str(err.value)


def test_read_regular_names_its_bound(tmp_path):
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_TOML_BYTES + 1))
    with pytest.raises(InputTooLargeError, match="over the 1 MiB a job file may hold"):
        read_regular(big, what="job file", limit=MAX_TOML_BYTES)
    # a file whose size says 0 but which holds more (/proc) is bounded by what is read
    with pytest.raises(InputTooLargeError, match="holds more than the 16 bytes"):
        read_regular("/proc/self/status", what="status", limit=16)
    assert read_regular(big, what="job file", limit=2 * MAX_TOML_BYTES)[:1] == b"#"


def test_data_prepare_skips_a_fifo_in_a_directory_and_refuses_a_named_one(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text to train on\n" * 20)
    fifo(corpus / "pipe.txt")
    done = mpihybrid("data", "prepare", corpus, "-o", tmp_path / "out", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "1 files" in done.stdout and "1 skipped" in done.stdout
    named = mpihybrid("data", "prepare", corpus / "pipe.txt", "-o", tmp_path / "o2")
    one_error_line(named, "pipe.txt is a FIFO (named pipe), not a regular file")
    device = mpihybrid("data", "prepare", "/dev/zero", "-o", tmp_path / "o3")
    one_error_line(device, "/dev/zero is a character device")
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_csv_schedule_and_cluster_file_on_a_fifo(tmp_path):
    pipe = fifo(tmp_path / "s.csv")
    shown = mpihybrid("schedule", "show", "--schedule", f"csv:{pipe}", "--pp", "2", "-m", "4")
    one_error_line(shown, "CSV schedule", "is a FIFO")
    cluster = fifo(tmp_path / "c.toml")
    predicted = mpihybrid("predict", "jobs/seed_k3_d4.toml", "--cluster", cluster)
    one_error_line(predicted, "cluster file", "is a FIFO")


def test_token_files_and_tokenizer_on_a_fifo(tmp_path):
    from mpihybrid.nn.tokenizer import load_tokenizer
    from mpihybrid.nn.tokens import DataError, TokenShards

    write_tokens(tmp_path / "a.bin", np.arange(64) % 7)
    fifo(tmp_path / "b.bin")
    with pytest.raises(DataError, match="b.bin is a FIFO"):
        TokenShards(str(tmp_path / "*.bin"), 8)  # a glob matching a FIFO: refused, not skipped
    with pytest.raises(DataError, match="b.bin is a FIFO"):
        TokenShards(str(tmp_path / "b.bin"), 8)
    with pytest.raises(DataError, match="tokenizer .* is a FIFO"):
        load_tokenizer(fifo(tmp_path / "tokenizer.json"))


@pytest.mark.mpi
def test_config_time_fifos_exit_2_on_every_rank(tmp_path):
    """A job file or a csv: schedule on a FIFO blocked every rank in open(); now each rank
    refuses it from a stat, and all agree on the one line before any message is sent."""
    job, csv = fifo(tmp_path / "job.toml"), fifo(tmp_path / "s.csv")
    for args in ([str(job)], ["--set", f"train.schedule=csv:{csv}"]):
        proc = run_mpi(2, "-m", "mpihybrid", "train", "--quiet", *args, timeout=TIMEOUT)
        one_error_line(proc, "is a FIFO (named pipe), not a regular file")


def test_bounds_are_input_file_errors():
    assert issubclass(InputTooLargeError, InputFileError)
    assert issubclass(NotRegularFileError, InputFileError)


# --- issue #41's smaller cases: CSV cells, predict --world, shards of two tokenizers -------------


@pytest.mark.parametrize(
    "row, words",
    [
        ("0F0," + "x" * 1_000_000, "not a CSV schedule (field larger than field limit"),
        ("0F0," + "1" * 1000 + "F0", "a cell of 1,002 characters (an action takes at most 64)"),
        ("0F" + "9" * 100_000, "a cell of 100,002 characters"),
        ("0F123456", "an index above 65535"),
        ("0F0,\0", "is not an action like"),
    ],
)
def test_a_huge_csv_cell_or_index_is_one_line(tmp_path, row, words):
    (tmp_path / "s.csv").write_text(row + "\n")
    shown = mpihybrid("schedule", "show", "--schedule", f"csv:{tmp_path / 's.csv'}")
    one_error_line(shown, words)


@pytest.mark.parametrize("world", ["0", "-4"])
def test_predict_search_refuses_a_world_below_one(world):
    proc = mpihybrid("predict", "jobs/seed_k3_d4.toml", "--search", "--world", world)
    one_error_line(proc, f"--world {world}: must be >= 1")


def _text_job(train: str, val: str, vocab: int = 512):
    from mpihybrid.config import build_job

    return build_job({
        "model": {"kind": "gpt", "hidden": 16, "depth": 2, "heads": 2},
        "data": {"kind": "tokens", "vocab": vocab, "seq_len": 8, "test_samples": 8,
                 "train": train, "val": val},
        "train": {"global_batch": 8, "microbatches": 2},
    })  # fmt: skip


def _prepared(folder, tokenizer):
    from mpihybrid.nn.tokenizer import BpeTokenizer, ByteTokenizer

    folder.mkdir()
    tokens = np.arange(200) % 250
    write_tokens(folder / "train.bin", tokens)
    write_tokens(folder / "val.bin", tokens)
    made = ByteTokenizer() if tokenizer == "byte" else BpeTokenizer.train([folder.name * 50], 300)
    (folder / "tokenizer.json").write_text(json.dumps(made.to_dict()))


def test_shards_of_two_tokenizers_are_refused_before_a_step(tmp_path):
    from mpihybrid.nn import data
    from mpihybrid.nn.tokens import DataError

    def check_data(job):
        data.check_data(job.data, job.train.global_batch)

    _prepared(tmp_path / "a", "byte")
    _prepared(tmp_path / "b", "bpe")
    glob = str(tmp_path / "*" / "train.bin")
    with pytest.raises(DataError) as err:
        check_data(_text_job(glob, str(tmp_path / "a" / "val.bin")))
    message = str(err.value)
    assert "\n" not in message and "shards of two tokenizers" in message
    assert f"{tmp_path / 'a' / 'train.bin'} (byte tokenizer of 256 tokens" in message
    assert f"{tmp_path / 'b' / 'train.bin'} (bpe tokenizer of " in message
    (tmp_path / "b" / "tokenizer.json").unlink()  # one beside a tokenizer, one beside none
    with pytest.raises(DataError, match="no tokenizer.json beside it"):
        check_data(_text_job(glob, str(tmp_path / "a" / "val.bin")))
    # val prepared with another tokenizer than train
    with pytest.raises(DataError, match="data.val shard"):
        check_data(_text_job(str(tmp_path / "a" / "train.bin"), str(tmp_path / "b" / "val.bin")))
    check_data(_text_job(str(tmp_path / "a" / "train.bin"), str(tmp_path / "a" / "val.bin")))


def test_jobs_md_names_every_schedule_and_csv():
    from mpihybrid.pipeline.schedules import SCHEDULES

    row = next(line for line in (ROOT / "docs" / "jobs.md").read_text().splitlines()
               if line.startswith("| `train.schedule`"))  # fmt: skip
    assert all(f"`{name}`" in row for name in SCHEDULES) and "`csv:PATH`" in row
    assert len(SCHEDULES) == 9


def test_jobs_md_has_a_row_for_every_setting():
    """docs/jobs.md is "every key": a setting added to a section (model.vocab_parallel had no
    row) is a row there too."""
    from dataclasses import fields

    from mpihybrid.config.job import SECTION_TYPES

    rows = [line.split("|")[1] for line in (ROOT / "docs" / "jobs.md").read_text().splitlines()
            if line.startswith("| `")]  # fmt: skip
    missing = [
        f"{section}.{f.name}"
        for section, make in SECTION_TYPES.items()
        for f in fields(make())
        if not any(f"`{section}.{f.name}`" in row for row in rows)
    ]
    assert not missing, f"docs/jobs.md has no row for {', '.join(missing)}"


def test_model_init_and_its_config_on_a_fifo(tmp_path):
    """model.init (safetensors) is opened by the library's own open(): a FIFO would block every
    rank in config validation; the JSON config beside it likewise."""
    from mpihybrid.config import ConfigError, load_job

    sets = ["model.kind=gpt", "model.hidden=16", "model.depth=2", "model.heads=2",
            'data.kind="random-tokens"', "data.vocab=64", "data.seq_len=8"]  # fmt: skip
    fifo(tmp_path / "w.safetensors")
    with pytest.raises(ConfigError, match="model.init .*w.safetensors is a FIFO"):
        load_job(None, [*sets, f"model.init={tmp_path / 'w.safetensors'}"], 1)
    from tests.test_weights import _file, job

    good = _file(tmp_path)
    (tmp_path / "m.json").unlink(missing_ok=True)
    fifo(tmp_path / "m.json")
    with pytest.raises(ConfigError, match="model.init's config .*m.json is a FIFO"):
        job(f"model.init={good}")
