"""`generate`: options checked in one line before anything loads, a model vocabulary larger than
its tokenizer's sampled safely, and text printed as it comes (a billion tokens show at once)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest

from mpihybrid.cli.text import sample
from mpihybrid.nn.tokens import write_tokens
from tests.helpers import ROOT, mpi_env, run_mpi

TIMEOUT = 60


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpihybrid", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=mpi_env(),
                          timeout=TIMEOUT)  # fmt: skip


@pytest.mark.parametrize(
    "option, value, rule",
    [
        ("--temperature", "nan", "must be a finite number >= 0"),
        ("--temperature", "inf", "must be a finite number >= 0"),
        ("--temperature", "-0.5", "must be a finite number >= 0"),
        ("--top-k", "0", "must be >= 1"),
        ("--top-k", "-3", "must be >= 1"),
        ("--tokens", "-1", "must be >= 0"),
        ("--seed", "-1", "must be >= 0"),
    ],
)
def test_a_bad_sampling_option_is_one_line_before_loading(tmp_path, option, value, rule):
    proc = cli("generate", tmp_path / "no-checkpoint", option, value)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"mpihybrid: error: {option} {value}: {rule}\n"


def test_sample_stays_among_the_logits_it_is_given():
    rng = np.random.default_rng(0)
    logits = np.zeros(256)
    assert {sample(logits, 1.0, 0, rng) for _ in range(500)} <= set(range(256))
    assert sample(np.arange(10.0), 0.0, 0, rng) == 9
    assert {sample(np.arange(10.0), 1.0, 2, rng) for _ in range(200)} == {8, 9}


@pytest.mark.mpi
def test_a_model_vocabulary_past_its_tokenizer_streams_text(tmp_path):
    """data.vocab = 300 over the byte tokenizer (256): ids 256..299 have no text. generate
    said nothing and died at the end; now it samples among the tokenizer's ids, says so in one
    line, and prints as it goes: with --tokens 10^9 the first text comes at once."""
    data = tmp_path / "data"
    data.mkdir()
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 40, np.uint8)
    write_tokens(data / "train.bin", text)
    write_tokens(data / "val.bin", text[:400])
    (data / "tokenizer.json").write_text('{"format": "mpihybrid-tokenizer", "kind": "byte", '
                                         '"vocab": 256}')  # fmt: skip
    sets = ["model.kind=gpt", "model.hidden=16", "model.depth=2", "model.heads=2",
            'data.kind="tokens"', f'data.train="{data}/train.bin"', f'data.val="{data}/val.bin"',
            "data.vocab=300", "data.seq_len=16", "data.test_samples=8", "grid.pp=1", "grid.dp=1",
            "train.steps=2", "train.global_batch=4", "train.microbatches=1",
            f'checkpoint.dir="{tmp_path}/ckpt"', "checkpoint.every=2"]  # fmt: skip
    proc = run_mpi(1, "-m", "mpihybrid", "train", "--quiet",
                   *[a for s in sets for a in ("--set", s)], timeout=TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = cli("generate", tmp_path / "ckpt", "--prompt", "the ", "--tokens", 50, "--seed", 1)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith("the ") and len(out.stdout.encode()) > 4
    assert out.stderr == (
        "mpihybrid: note: the model has 300 tokens, its tokenizer 256: sampling among the "
        "tokenizer's 256\n"
    )
    endless = subprocess.Popen([sys.executable, "-m", "mpihybrid", "generate",
                                str(tmp_path / "ckpt"), "--prompt", "the ", "--tokens",
                                str(10**9), "--temperature", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=mpi_env(),
                               cwd=ROOT)  # fmt: skip
    try:
        got, deadline = b"", time.monotonic() + TIMEOUT
        while len(got) < 24 and time.monotonic() < deadline:
            if select.select([endless.stdout], [], [], 1.0)[0]:
                got += os.read(endless.stdout.fileno(), 4096)
        assert got.startswith(b"the ") and len(got) >= 24, got  # prompt and 20 tokens, live
    finally:
        endless.kill()
        endless.wait(TIMEOUT)


def test_a_checkpoint_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    from mpihybrid.config import build_job, to_toml
    from mpihybrid.nn.tokenizer import ByteTokenizer
    from mpihybrid.train.checkpoint import FORMAT

    job = build_job({"model": {"kind": "gpt", "hidden": 16, "depth": 2, "heads": 2},
                     "data": {"kind": "random-tokens", "vocab": 256, "seq_len": 8}})  # fmt: skip
    step = tmp_path / "step-000001"
    step.mkdir()
    manifest = {"format": FORMAT, "version": 2, "job": to_toml(job)}
    (step / "manifest.json").write_text(json.dumps(manifest))
    (step / "tokenizer.json").write_text(json.dumps(ByteTokenizer().to_dict()))
    os.mkfifo(step / "stage-000.h5")
    proc = cli("generate", step, "--tokens", 3)
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr == f"mpihybrid: error: checkpoint file {step / 'stage-000.h5'} is a FIFO "
        "(named pipe), not a regular file\n"
    )
