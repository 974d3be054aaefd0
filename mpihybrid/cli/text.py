"""Text in, text out: `data prepare` turns text files into token files, `generate` samples from a
checkpoint (registered lazily by mpihybrid.cli.commands).

    mpihybrid data prepare notes/ book.txt -o data/mine [--tokenizer byte|bpe] [--vocab N]
    mpiexec -n 2 mpihybrid train jobs/text_gpt.toml --set data.train=data/mine/train.bin ...
    mpihybrid generate runs/text_ckpt --prompt "def " --tokens 200 --temperature 0.8 --top-k 40

Both run in one process (no mpiexec needed); errors are one line and exit 2, and `data prepare`
writes nothing until every input has been read and checked.
"""

from __future__ import annotations

import codecs
import fnmatch
import math
import os
import sys
import time
from pathlib import Path

import click
import numpy as np

from mpihybrid.cli.commands import EXIT_USAGE

SHARD_TOKENS = 100_000_000  # tokens per train shard (llm.c's fineweb shards are this size)
DEFAULT_BPE_VOCAB = 4096
MAX_TEXT_BYTES = 1 << 30  # one input file: held in memory as text, then as 2-byte tokens


def _fail(message: str) -> None:
    click.echo(f"mpihybrid: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


@click.group()
def data() -> None:
    """Prepare text for training: llm.c-format token files and their tokenizer."""


@data.command("prepare")
@click.argument("texts", nargs=-1, required=True, metavar="TEXT...")
@click.option("-o", "--output", required=True, metavar="DIR", help="Directory to write into.")
@click.option(
    "--tokenizer",
    "kind",
    type=click.Choice(["byte", "bpe"]),
    default="byte",
    show_default=True,
    help="byte: a token per UTF-8 byte (vocab 256); bpe: byte-level BPE trained on this corpus "
    "(needs `tokenizers`: mpihybrid[text]).",
)
@click.option("--vocab", type=int, help=f"bpe: vocabulary size, 257..65536 [{DEFAULT_BPE_VOCAB}].")
@click.option(
    "--val-fraction",
    type=float,
    default=0.1,
    show_default=True,
    help="The corpus's last fraction of tokens held out as val.bin.",
)
@click.option(
    "--glob",
    "pattern",
    default="*",
    show_default=True,
    help="In directories: the file names to read (e.g. '*.py').",
)
@click.option(
    "--exclude",
    multiple=True,
    metavar="NAME",
    help="In directories: leave out files and directories of this name or glob "
    "(repeatable, e.g. --exclude site-packages --exclude test).",
)
@click.option("--overwrite", is_flag=True, help="Replace token files already in DIR.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
def prepare(
    *, texts, output, kind, vocab, val_fraction, pattern, exclude, overwrite, quiet
) -> None:
    """Read UTF-8 TEXT files and directories (recursively, sorted; files there that are not
    UTF-8 text are skipped and counted) and write DIR/train.bin, DIR/val.bin (llm.c's format)
    and DIR/tokenizer.json."""
    from mpihybrid.cli.progress import progress_echo
    from mpihybrid.nn.tokenizer import TOKENIZER_FILE, BpeTokenizer, ByteTokenizer
    from mpihybrid.nn.tokens import DataError

    progress = progress_echo(0, quiet)
    if not 0.0 < val_fraction < 1.0:
        _fail(f"--val-fraction {val_fraction}: must be between 0 and 1 (exclusive)")
    if kind == "byte" and vocab is not None and vocab != 256:
        _fail(
            f"--vocab {vocab}: the byte tokenizer's vocabulary is always 256 (use --tokenizer bpe)"
        )
    vocab = vocab or DEFAULT_BPE_VOCAB
    if kind == "bpe" and not 257 <= vocab <= 65536:
        _fail(f"--vocab {vocab}: must be in 257..65536 (256 bytes + <|endoftext|>, uint16 tokens)")
    out = Path(output)
    targets = [out / "train.bin", out / "val.bin", out / TOKENIZER_FILE]
    if out.exists() and not out.is_dir():
        _fail(f"-o {output}: is a file, not a directory")
    in_the_way = [str(p) for p in [*targets, *out.glob("train_*.bin")] if p.exists()]
    if in_the_way and not overwrite:
        _fail(f"{in_the_way[0]} already exists (--overwrite replaces it)")
    try:
        documents, skipped, nbytes = read_texts(texts, pattern, exclude, progress)
        if kind == "byte":
            tokenizer = ByteTokenizer()
        else:
            progress(f"training a bpe tokenizer of {vocab} tokens on {nbytes:,} bytes")
            tokenizer = BpeTokenizer.train(documents, vocab, len(documents))
        tokens = encode_all(tokenizer, documents, progress)
    except DataError as exc:
        _fail(str(exc))
    n_val = int(round(len(tokens) * val_fraction))
    if n_val < 1 or len(tokens) - n_val < 1:
        _fail(
            f"{len(tokens)} tokens cannot be split by --val-fraction {val_fraction} "
            "(train and val each need at least one token)"
        )
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    write_outputs(out, train, val, tokenizer, overwrite or bool(in_the_way))
    counts = np.bincount(train, minlength=tokenizer.vocab)
    p = counts[counts > 0] / len(train)
    entropy = float(-(p * np.log(p)).sum())
    click.echo(
        f"{len(documents)} files ({nbytes:,} bytes; {skipped} skipped: empty, binary, not "
        f"UTF-8 or not a regular file) -> {out}: train {len(train):,} tokens, val "
        f"{len(val):,} tokens, {kind} tokenizer of {tokenizer.vocab} tokens "
        f"(data.vocab = {tokenizer.vocab})\n"
        f"unigram entropy of train: {entropy:.4f} nats/token ({entropy / math.log(2):.3f} "
        "bits/token): a model that learns nothing but token frequencies reaches this loss"
    )


def _walk(root: Path, pattern: str, exclude: tuple[str, ...]) -> list[Path]:
    """Files under a directory whose names match, sorted; hidden names, caches and excluded
    names left out."""

    def keep(name: str) -> bool:
        return not name.startswith(".") and not any(fnmatch.fnmatch(name, e) for e in exclude)

    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if keep(d) and d != "__pycache__")
        for name in sorted(files):
            if keep(name) and fnmatch.fnmatch(name, pattern):
                found.append(Path(here) / name)
    return found


def _text_of(path: Path) -> str:
    """The file's text, or raises DataError naming why it is not UTF-8 text (InputFileError:
    not a regular file, or over MAX_TEXT_BYTES)."""
    from mpihybrid.inputs import read_regular
    from mpihybrid.nn.tokens import DataError

    raw = read_regular(path, what="text file", limit=MAX_TEXT_BYTES)
    if not raw:
        raise DataError(f"{path} is empty")
    if b"\0" in raw[: 1 << 16]:
        raise DataError(f"{path} is binary (it holds NUL bytes), not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text (byte {exc.start} cannot be decoded)") from None


def read_texts(texts, pattern: str, exclude, progress) -> tuple[list[str], int, int]:
    """Every text: named files must be regular files of UTF-8 text (else DataError); a
    directory's files that are not (a FIFO, a device, a binary file) are skipped and counted.
    A file over MAX_TEXT_BYTES is refused wherever it is. Returns (documents, skipped, bytes)."""
    from mpihybrid.inputs import InputFileError, InputTooLargeError
    from mpihybrid.nn.tokens import DataError

    named: list[tuple[Path, bool]] = []
    for text in texts:
        path = Path(text)
        if path.is_dir():
            found = _walk(path, pattern, tuple(exclude))
            if not found:
                raise DataError(f"{text}: a directory with no file matching {pattern!r}")
            named += [(p, False) for p in found]
        elif path.exists():
            named.append((path, True))
        else:
            raise DataError(f"{text}: no such file or directory")
    documents, skipped, nbytes, last = [], 0, 0, time.monotonic()
    for i, (path, must) in enumerate(named):
        try:
            documents.append(_text_of(path))
            nbytes += len(documents[-1].encode("utf-8"))
        except InputTooLargeError as exc:
            raise DataError(f"{exc} (split it, or --exclude it)") from None
        except (DataError, InputFileError) as exc:
            if must:
                raise DataError(str(exc)) from None
            skipped += 1
        if time.monotonic() - last > 2:
            progress(f"read {i + 1}/{len(named)} files")
            last = time.monotonic()
    if not documents:
        raise DataError(f"no UTF-8 text in {', '.join(texts)} ({skipped} files skipped)")
    return documents, skipped, nbytes


def encode_all(tokenizer, documents: list[str], progress) -> np.ndarray:
    """The documents' tokens in order, the tokenizer's separator between two."""
    parts, last = [], time.monotonic()
    for i, text in enumerate(documents):
        if i:
            parts.append(tokenizer.separator())
        parts.append(tokenizer.encode(text))
        if time.monotonic() - last > 2:
            progress(f"encoded {i + 1}/{len(documents)} files")
            last = time.monotonic()
    return np.concatenate(parts).astype(np.uint16)


def write_outputs(out: Path, train, val, tokenizer, overwrite: bool) -> None:
    """Token files and the tokenizer, each atomically; train in shards past SHARD_TOKENS."""
    import json

    from mpihybrid.files import write_atomic
    from mpihybrid.nn.tokenizer import TOKENIZER_FILE
    from mpihybrid.nn.tokens import write_tokens

    try:
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("train_*.bin"):
            old.unlink()
        if len(train) <= SHARD_TOKENS:
            write_tokens(out / "train.bin", train, overwrite)
        else:
            (out / "train.bin").unlink(missing_ok=True)
            for k, lo in enumerate(range(0, len(train), SHARD_TOKENS)):
                write_tokens(out / f"train_{k:06d}.bin", train[lo : lo + SHARD_TOKENS], overwrite)
        write_tokens(out / "val.bin", val, overwrite)
        write_atomic(out / TOKENIZER_FILE, json.dumps(tokenizer.to_dict()), overwrite)
    except OSError as exc:
        _fail(str(exc))


def _checked(rule: str, test):
    """A click callback: the value, or one line and exit 2 naming the option and `rule`."""

    def callback(ctx, param, value):
        if value is not None and not test(value):
            _fail(f"{param.opts[0]} {value}: {rule}")
        return value

    return callback


@click.command()
@click.argument("checkpoint_dir", metavar="CHECKPOINT_DIR")
@click.option("--prompt", default="", help="Text to continue (default: the start of a document).")
@click.option(
    "--tokens",
    "count",
    type=int,
    default=200,
    show_default=True,
    callback=_checked("must be >= 0", lambda v: v >= 0),
    help="Tokens to generate (printed as they come).",
)
@click.option(
    "--temperature",
    type=float,
    default=1.0,
    show_default=True,
    callback=_checked("must be a finite number >= 0", lambda v: math.isfinite(v) and v >= 0),
    help="Divides the logits; 0 = always the most likely token.",
)
@click.option(
    "--top-k",
    type=int,
    callback=_checked("must be >= 1", lambda v: v >= 1),
    help="Sample among the k most likely tokens only [all].",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    callback=_checked("must be >= 0", lambda v: v >= 0),
    help="Seeds the sampling.",
)
@click.option(
    "--tokenizer",
    "tokenizer_name",
    default=None,
    metavar="byte|PATH",
    help="byte, or a tokenizer.json: for a checkpoint of token files made elsewhere "
    "(default: the checkpoint's own, or the one beside its data.train).",
)
@click.option(
    "--ids", is_flag=True, help="Token ids in and out, no tokenizer: --prompt '464 3290'."
)
def generate(*, checkpoint_dir, prompt, count, temperature, top_k, seed, tokenizer_name, ids):
    """Sample text from a checkpoint of a GPT trained on token files (a checkpoint.dir, its
    newest complete checkpoint, or one step-N directory), written by any pp x dp grid: every
    stage is loaded into this one process; the text goes through the tokenizer kept in the
    checkpoint (or the one beside the job's data.train) and is printed as it comes."""
    from mpihybrid.nn.tokens import DataError

    try:
        choice = "ids" if ids else tokenizer_name
        model, tokenizer, seq_len, vocab = load_model(Path(checkpoint_dir), choice)
    except DataError as exc:
        _fail(str(exc))
    if ids:
        _generate_ids(
            model, _prompt_ids(prompt, vocab), seq_len, count, temperature, top_k=top_k, seed=seed
        )
        return
    if vocab > tokenizer.vocab:  # ids past the tokenizer's have no text: never sampled
        click.echo(
            f"mpihybrid: note: the model has {vocab} tokens, its tokenizer {tokenizer.vocab}: "
            f"sampling among the tokenizer's {tokenizer.vocab}",
            err=True,
        )
    context = list(tokenizer.encode(prompt)) or list(tokenizer.separator()) or [ord("\n")]
    rng = np.random.default_rng(seed)
    text = codecs.getincrementaldecoder("utf-8")("replace")  # a character split over tokens
    try:
        click.echo(prompt, nl=False)  # click.echo flushes: the text shows as it comes
        for _ in range(count):
            x = np.asarray([context[-seq_len:]], np.int64)
            for stage in model:
                x, _cache = stage.forward(x)
            logits = x[0, -1, : tokenizer.vocab].astype(np.float64)
            token = sample(logits, temperature, top_k or 0, rng)
            context.append(token)
            click.echo(text.decode(tokenizer.token_bytes(token)), nl=False)
        click.echo(text.decode(b"", final=True))
    except BrokenPipeError:  # `| head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except KeyboardInterrupt:
        click.echo("")
        sys.exit(130)


def _prompt_ids(prompt: str, vocab: int) -> list[int]:
    """--ids: the prompt as token ids (spaces or commas between them; empty: token 0)."""
    try:
        context = [int(x) for x in prompt.replace(",", " ").split()]
    except ValueError:
        _fail(f"--prompt {prompt[:40]!r}: with --ids, give token ids (e.g. '464 3290')")
    if any(not 0 <= t < vocab for t in context):
        _fail(f"--prompt: a token id outside the model's vocabulary [0, {vocab})")
    return context or [0]


def _generate_ids(model, context, seq_len, count, temperature, *, top_k, seed) -> None:
    """--ids: the sampled token ids, space-separated, as they come."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        x = np.asarray([context[-seq_len:]], np.int64)
        for stage in model:
            x, _cache = stage.forward(x)
        token = sample(x[0, -1].astype(np.float64), temperature, top_k or 0, rng)
        context.append(token)
        click.echo(f"{' ' if i else ''}{token}", nl=False)
    click.echo("")


def sample(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """A token from softmax(logits / temperature) over the top_k largest (0: all)."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    if 0 < top_k < len(logits):
        logits = np.where(logits >= np.partition(logits, -top_k)[-top_k], logits, -np.inf)
    z = logits / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def load_model(path: Path, choice: str | None = None):
    """Every stage of a checkpoint, in order, with its tokenizer, context length and the
    model's vocabulary; choice: "byte", a tokenizer.json's path, "ids" (no tokenizer: None),
    None (the checkpoint's own, or the one beside its data.train)."""
    from mpihybrid.nn.tokenizer import (
        TOKENIZER_FILE,
        ByteTokenizer,
        load_tokenizer,
        tokenizer_beside,
    )
    from mpihybrid.nn.tokens import DataError

    job, path, manifest = read_checkpoint(path)
    kept, beside = path / TOKENIZER_FILE, tokenizer_beside(job.data.train or ".")
    if choice == "ids":
        return checkpoint_stages(path, job, manifest), None, job.data.seq_len, job.data.vocab
    if choice is not None:
        tokenizer = ByteTokenizer() if choice == "byte" else load_tokenizer(choice)
    elif kept.is_file():
        tokenizer = load_tokenizer(kept)
    elif job.data.kind == "tokens" and beside.is_file():
        tokenizer = load_tokenizer(beside)
    else:
        raise DataError(
            f"{path}: no {TOKENIZER_FILE} in the checkpoint nor beside its data.train "
            f"({job.data.train or 'none: data.kind = ' + job.data.kind}); generate needs the "
            "tokenizer the data were prepared with (--tokenizer byte|PATH, or --ids)"
        )
    model = checkpoint_stages(path, job, manifest)
    d = job.data
    if tokenizer.vocab > d.vocab:
        raise DataError(f"{path}: its tokenizer has {tokenizer.vocab} tokens, the model {d.vocab}")
    return model, tokenizer, d.seq_len, d.vocab


def read_checkpoint(path: Path):
    """(job, step directory, manifest) of a GPT's checkpoint: a checkpoint.dir (its newest
    complete checkpoint) or one step-N directory; DataError (one line) otherwise."""
    from mpihybrid.config import ConfigError, build_job
    from mpihybrid.config import tomllib as toml
    from mpihybrid.nn.kinds import KINDS
    from mpihybrid.nn.tokens import DataError
    from mpihybrid.train import checkpoint

    if not path.is_dir():
        raise DataError(f"{path}: no such checkpoint directory")
    if not (path / "manifest.json").is_file():
        newest = checkpoint.latest(path)
        if newest is None:
            raise DataError(f"{path}: no complete checkpoint (a step-N directory with manifest)")
        path = newest
    try:
        manifest = checkpoint.read_manifest(path)
        job = build_job(toml.loads(manifest["job"]))
    except (checkpoint.CheckpointError, ConfigError, KeyError, toml.TOMLDecodeError) as exc:
        raise DataError(f"{path}: not a readable mpihybrid checkpoint ({exc})") from None
    if job.model.kind not in KINDS or not KINDS[job.model.kind].tokens:
        raise DataError(f"{path}: a {job.model.kind} model; this needs a gpt")
    return job, path, manifest


def checkpoint_stages(path: Path, job, manifest: dict) -> list:
    """Every stage of the checkpoint at `path` (a step directory), in order, in this process."""
    import h5py

    from mpihybrid.inputs import InputFileError, check_regular
    from mpihybrid.nn.tokens import DataError
    from mpihybrid.nn.vocab_weights import unsplit, whole_model
    from mpihybrid.train import checkpoint, tie

    d, num_stages = job.data, job.grid.pp * job.train.virtual_stages
    # model.vocab_parallel: the shares' files follow the stages'; the whole model is rebuilt
    shares = job.grid.pp if job.model.vocab_parallel else 0
    model = []
    for s in range(num_stages + shares):
        stage = _checkpoint_chunk(job, s, num_stages)
        name = f"stage-{s:03d}.h5"
        digest = manifest.get("files", {}).get(name)
        try:
            check_regular(path / name, what="checkpoint file")  # a FIFO would block open()
            if digest is not None and checkpoint.file_digest(path / name) != digest:
                raise DataError(
                    f"{path}: {name} is damaged (its sha256 differs from the manifest's)"
                )
            with h5py.File(path / name, "r") as f:
                params = f["params"][()]
        except InputFileError as exc:
            raise DataError(str(exc)) from None
        except (OSError, KeyError) as exc:
            raise DataError(f"{path}: {name} unreadable ({exc})") from None
        if params.shape != stage.flat_params.shape:
            raise DataError(f"{path}: {name} does not fit the checkpoint's own model")
        stage.flat_params[...] = params
        model.append(stage)
    if shares:
        flats = [st.flat_params for st in model]
        model = [whole_model(job.model, d.seq_len, d.vocab, flats, shares, seed=job.train.seed)]
    tie.bind_local(model, unsplit(job.model))  # a tied head reads the table (no-op untied)
    return model


def _checkpoint_chunk(job, s: int, num_stages: int):
    """Chunk s of a checkpoint's model, its weights to be read: a stage, or past the stages a
    vocabulary share (model.vocab_parallel)."""
    from mpihybrid.nn.model import Stage, build_stage
    from mpihybrid.nn.vocab import share_layer

    d, seed = job.data, job.train.seed
    if s < num_stages:
        return build_stage(job.model, d.seq_len, d.vocab, s, num_stages, seed=seed)
    layer = share_layer(job.model, d.seq_len, d.vocab, job.grid.pp, s - num_stages, seed=seed)
    return Stage([[layer]], 0, seed)
