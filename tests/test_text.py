"""Training on text: llm.c token files, windows from the step, tokenizers, `data prepare`,
held-out loss, `generate`, and every bad input as one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpihybrid.config import build_job
from mpihybrid.nn.data import TextTask, replica_microbatches
from mpihybrid.nn.tokenizer import ByteTokenizer, load_tokenizer
from mpihybrid.nn.tokens import DataError, TokenShards, open_tokens, write_tokens
from tests.helpers import ROOT, mpi_env, results, run_mpi
from tests.test_trace_doc import rows as doc_rows

TEXT = "def add(a, b):\n    return a + b  # ünïcödé ✓\n" * 40


def llmc_file(path, tokens, magic=20240520, version=1, count=None) -> None:
    """A token file the way llm.c's dev/data/data_common.py writes one (not our writer)."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1] = magic, version
    header[2] = len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpihybrid", *args],
        capture_output=True, text=True, cwd=cwd or ROOT, env=mpi_env(), timeout=120,
    )  # fmt: skip


def text_job(tmp_path, **data) -> object:
    table = {
        "model": {"kind": "gpt", "hidden": 16, "depth": 2, "heads": 2},
        "data": {"kind": "tokens", "vocab": 256, "seq_len": 8, "test_samples": 8,
                 "train": str(tmp_path / "train.bin"), "val": str(tmp_path / "val.bin"), **data},
        "train": {"global_batch": 8, "microbatches": 2},
    }  # fmt: skip
    return build_job(table)


# --- token files ---------------------------------------------------------------------------


def test_an_llmc_file_reads_back_and_ours_is_byte_for_byte_llmcs(tmp_path):
    tokens = np.arange(1000) % 50257
    llmc_file(tmp_path / "theirs.bin", tokens)
    write_tokens(tmp_path / "ours.bin", tokens)
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()
    read = open_tokens(tmp_path / "theirs.bin")
    assert isinstance(read, np.memmap) and np.array_equal(read, tokens)


@pytest.mark.parametrize(
    "kwargs, cut, message",
    [
        ({"magic": 20240522}, 0, "magic number 20240522, expected 20240520"),
        ({"version": 2}, 0, "version 2, this reader reads 1"),
        ({"count": 99}, 0, "header's count 99 needs"),
        ({}, 3, "header's count 100 needs"),  # truncated
    ],
)
def test_a_bad_token_file_is_named_with_its_fault(tmp_path, kwargs, cut, message):
    path = tmp_path / "bad.bin"
    llmc_file(path, np.arange(100), **kwargs)
    if cut:
        path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(DataError, match=message):
        open_tokens(path)


def test_windows_never_cross_shards_and_are_numbered_over_all(tmp_path):
    llmc_file(tmp_path / "s_0.bin", np.arange(0, 10))
    llmc_file(tmp_path / "s_1.bin", np.arange(100, 106))
    shards = TokenShards(str(tmp_path / "s_*.bin"), seq_len=4)
    assert shards.num_windows == (10 - 4) + (6 - 4)
    x, y = shards.windows(np.array([0, 5, 6, 7]))
    assert x.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8], [100, 101, 102, 103], [101, 102, 103, 104]]
    assert np.array_equal(y[:, :-1], x[:, 1:]) and y[:, -1].tolist() == [4, 9, 104, 105]


def test_a_replica_reads_its_own_rows_of_the_step_s_global_batch(tmp_path):
    llmc_file(tmp_path / "train.bin", np.arange(5000) % 256)
    llmc_file(tmp_path / "val.bin", np.arange(500) % 256)
    task = TextTask(text_job(tmp_path).data)
    x, y = task.global_batch(7, 8)
    assert np.array_equal(x, task.global_batch(7, 8)[0])  # the step alone decides
    assert not np.array_equal(x, task.global_batch(8, 8)[0])
    for dp_rank in range(2):
        mine = replica_microbatches(task, 7, 8, dp_rank, 2, num_microbatches=2)
        rows = np.concatenate([mx for mx, _ in mine])
        assert np.array_equal(rows, x[dp_rank * 4 : (dp_rank + 1) * 4])


@pytest.mark.parametrize(
    "train, data, message",
    [
        (np.arange(300) % 256, {"vocab": 200}, "holds token 255 >= data.vocab\\(200\\)"),
        (np.arange(8), {}, "longest shard has 8 tokens, shorter than one sequence"),
        (np.arange(14), {}, "6 windows of 9 tokens, fewer than one global batch"),
    ],
)
def test_data_that_cannot_train_is_refused(tmp_path, train, data, message):
    llmc_file(tmp_path / "train.bin", train)
    llmc_file(tmp_path / "val.bin", np.arange(100))
    with pytest.raises(DataError, match=message):
        TextTask(text_job(tmp_path, **data).data).check(8)


# --- tokenizers and data prepare -----------------------------------------------------------


def test_byte_tokens_are_utf8_bytes():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids.dtype == np.uint16 and len(ids) == len(TEXT.encode()) and ids.max() < 256
    assert tok.decode(ids) == TEXT


def test_prepare_writes_llmc_files_and_the_tokenizer(tmp_path):
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text(TEXT)
    (tmp_path / "src" / "sub" / "b.py").write_text(TEXT.upper())
    (tmp_path / "src" / "sub" / "c.bin").write_bytes(b"\x00\xff" * 10)  # not *.py: not read
    (tmp_path / "src" / "sub" / "d.py").write_bytes(b"\xff\xfe" * 10)  # skipped and counted
    out = tmp_path / "data"
    proc = cli("data", "prepare", str(tmp_path / "src"), "--glob", "*.py", "-o", str(out),
               "--val-fraction", "0.25")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "2 files" in proc.stdout and "1 skipped" in proc.stdout, proc.stdout
    assert "unigram entropy" in proc.stdout
    train, val = open_tokens(out / "train.bin"), open_tokens(out / "val.bin")
    corpus = (TEXT + TEXT.upper()).encode()
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == corpus
    assert len(val) == round(0.25 * len(corpus))
    assert load_tokenizer(out / "tokenizer.json").kind == "byte"


def test_prepare_bpe_round_trips_the_corpus(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "a.txt").write_text(TEXT)
    proc = cli("data", "prepare", str(tmp_path / "a.txt"), "-o", str(tmp_path / "d"),
               "--tokenizer", "bpe", "--vocab", "300")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    tok = load_tokenizer(tmp_path / "d" / "tokenizer.json")
    assert tok.kind == "bpe" and tok.vocab <= 300
    tokens = np.concatenate([open_tokens(tmp_path / "d" / n) for n in ("train.bin", "val.bin")])
    assert tok.decode(tokens) == TEXT and len(tokens) < len(TEXT.encode()) / 2


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file or directory"),
        (b"", "is empty"),
        (b"text\x00\x01\x02binary", "is binary"),
        ("caf\u00e9".encode("latin-1"), "is not UTF-8 text"),
    ],
)
def test_prepare_refuses_what_is_not_text_and_writes_nothing(tmp_path, content, message):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text(TEXT)
    if content is not None:
        bad.write_bytes(content)
    out = tmp_path / "out"
    out.mkdir()
    proc = cli("data", "prepare", str(good), str(bad), "-o", str(out))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert list(out.iterdir()) == []


def test_prepare_refuses_a_split_without_val_and_keeps_existing_files(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "out"
    assert cli("data", "prepare", str(tmp_path / "a.txt"), "-o", str(out)).returncode == 0
    again = cli("data", "prepare", str(tmp_path / "a.txt"), "-o", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr
    proc = cli("data", "prepare", str(tmp_path / "a.txt"), "-o", str(tmp_path / "o2"),
               "--val-fraction", "1.5")  # fmt: skip
    assert proc.returncode == 2 and "--val-fraction" in proc.stderr
    assert not (tmp_path / "o2").exists()


# --- under mpiexec: hybrid == serial, held-out loss, generate, bad data --------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    (root / "a.txt").write_text(TEXT * 3)
    proc = cli("data", "prepare", str(root / "a.txt"), "-o", str(root / "data"))
    assert proc.returncode == 0, proc.stderr
    return root


def sets(root, *more) -> list[str]:
    args = [
        "model.kind=gpt", "model.hidden=16", "model.depth=2", "model.heads=2",
        'data.kind="tokens"', f'data.train="{root}/data/train.bin"',
        f'data.val="{root}/data/val.bin"', "data.vocab=256", "data.seq_len=16",
        "data.test_samples=8", "train.optimizer=adamw", "train.lr=0.003", *more,
    ]  # fmt: skip
    return [a for s in args for a in ("--set", s)]


@pytest.mark.mpi
def test_text_hybrid_equals_serial(corpus):
    proc = run_mpi(4, "tests/_mpi_train.py", "--serial",
                   *sets(corpus, "grid.pp=2", "grid.dp=2", "train.steps=3",
                         "train.global_batch=8", "train.microbatches=2",
                         # sgd: AdamW's first steps turn summation-order noise in a near-zero
                         # gradient into a step of lr, so it cannot be compared to 1e-6
                         "train.optimizer=sgd", "train.lr=0.1"))  # fmt: skip
    (r,) = results(proc)
    print("max |hybrid - serial| =", r["max_abs_diff"])
    assert r["allclose"] and np.allclose(r["losses"], r["serial_losses"], rtol=1e-5), r


@pytest.mark.mpi
def test_held_out_loss_is_logged_traced_and_generate_reads_any_grid(corpus, tmp_path):
    trace, ckpt = tmp_path / "run.h5", tmp_path / "ckpt"
    proc = run_mpi(4, "-m", "mpihybrid", "train", "--trace", str(trace),
                   *sets(corpus, "grid.pp=2", "grid.dp=2", "train.steps=6", "train.eval_every=3",
                         "train.eval_batches=2", "train.global_batch=8", "train.microbatches=2",
                         f'checkpoint.dir="{ckpt}"', "checkpoint.every=6"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("val loss") == 2 and "bits/byte" in proc.stdout
    assert "held-out loss" in proc.stdout  # the report
    documented = {c[0].strip("`"): c[1] for c in doc_rows("`/eval`")}
    with h5py.File(trace) as f:
        assert {name: f["eval"][name].dtype for name in f["eval"]} == {
            name: np.dtype(kind) for name, kind in documented.items()
        }
        assert f["eval/step"][()].tolist() == [2, 5]
        loss = f["eval/loss"][()]
        assert np.allclose(f["eval/bits_per_byte"][()], loss / np.log(2))
    analysis = json.loads(cli("analyze", str(trace), "--json").stdout)
    assert analysis["quality"]["heldout"][-1]["step"] == 6
    assert analysis["quality"]["heldout"][-1]["loss"] == pytest.approx(loss[-1])
    out = cli("generate", str(ckpt), "--prompt", "def ", "--tokens", "40", "--seed", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def ") and len(out.stdout.encode()) >= 40
    again = cli("generate", str(ckpt), "--prompt", "def ", "--tokens", "40", "--seed", "1")
    assert again.stdout == out.stdout  # the seed decides
    (ckpt / "step-000006" / "tokenizer.json").unlink()
    (corpus / "data" / "tokenizer.json").rename(corpus / "tok.json")
    try:
        missing = cli("generate", str(ckpt), "--tokens", "5")
    finally:
        (corpus / "tok.json").rename(corpus / "data" / "tokenizer.json")
    assert missing.returncode == 2 and "no tokenizer.json" in missing.stderr, missing.stderr
    assert missing.stderr.count("\n") == 1


@pytest.mark.mpi
def test_bad_token_data_stops_every_rank_before_a_step(corpus, tmp_path):
    bad = tmp_path / "bad.bin"
    llmc_file(bad, np.arange(100), magic=1234)
    proc = run_mpi(2, "-m", "mpihybrid", "train",
                   *sets(corpus, "grid.pp=2", "train.steps=2", f'data.val="{bad}"'))  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"mpihybrid: error: token file {bad}: magic number 1234, expected 20240520 "
        "(not an llm.c token file)"
    ]
    assert "step" not in proc.stdout
