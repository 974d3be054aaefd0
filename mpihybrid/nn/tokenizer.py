"""Tokenizers that turn text into token files and tokens back into text: one JSON file,
`tokenizer.json`, beside the token files (and in every checkpoint of a run trained on them).

    byte  a token per UTF-8 byte: vocabulary 256, no dependency, bits/token = bits/byte
    bpe   byte-level BPE trained on the corpus by Hugging Face `tokenizers`
          (pip install 'mpihybrid[text]'); its own JSON is kept inside ours; GPT-2's
          pre-tokenisation, then runs over MAX_RUN_BYTES cut into pieces of that length

    {"format": "mpihybrid-tokenizer", "kind": "byte" | "bpe", "vocab": N, "bpe": {...}}
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from mpihybrid.inputs import InputFileError, MiB, read_text
from mpihybrid.nn.tokens import DataError, TokenShards

TOKENIZER_FILE = "tokenizer.json"
FORMAT = "mpihybrid-tokenizer"
END_OF_TEXT = "<|endoftext|>"  # bpe: between documents (token 0)
MAX_TOKENIZER_BYTES = 64 * MiB  # a bpe of 65536 tokens is a few MiB of JSON
MAX_RUN_BYTES = 256  # bpe: the longest piece of text the trainer sees as one word


class ByteTokenizer:
    kind = "byte"
    vocab = 256
    bytes_per_token = 1.0  # every token is one byte: bits/byte = bits/token

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)

    def decode(self, tokens: Iterable[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token (a character may take several: decode them together)."""
        return bytes([token])

    def separator(self) -> np.ndarray:
        return np.zeros(0, np.uint16)  # documents are simply concatenated

    def to_dict(self) -> dict:
        return {"format": FORMAT, "kind": self.kind, "vocab": self.vocab}


class BpeTokenizer:
    kind = "bpe"
    bytes_per_token = None  # varies by token: no bits/byte

    def __init__(self, hf) -> None:
        self.hf = hf
        self.vocab = hf.get_vocab_size()
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def train(cls, texts: Iterable[str], vocab: int, length: int | None = None) -> BpeTokenizer:
        """Byte-level BPE (GPT-2's pre-tokenisation) with `vocab` tokens, trained on texts."""
        tokenizers = require_tokenizers()
        pre = tokenizers.pre_tokenizers
        hf = tokenizers.Tokenizer(tokenizers.models.BPE())
        # a run of letters, digits, punctuation or spaces longer than MAX_RUN_BYTES is cut into
        # pieces of that many bytes (one character per byte after ByteLevel): the trainer
        # rescans a whole word at each merge, so one unsplit 256 KB run took 35 s, 4 MB hours
        hf.pre_tokenizer = pre.Sequence(
            [
                pre.ByteLevel(add_prefix_space=False),
                pre.Split(tokenizers.Regex(f".{{{MAX_RUN_BYTES}}}"), "isolated"),
            ]
        )
        hf.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer, length=length)
        return cls(hf)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.hf.encode(text).ids, np.uint16)

    def decode(self, tokens: Iterable[int]) -> str:
        return self.hf.decode([int(t) for t in tokens], skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token: its byte-level characters mapped back to bytes (GPT-2's
        table); a special token is its own text."""
        if token not in self._bytes:
            chars = self.hf.id_to_token(int(token)) or ""
            table = _byte_of_char()
            if all(c in table for c in chars):
                self._bytes[token] = bytes(table[c] for c in chars)
            else:
                self._bytes[token] = self.hf.decode([int(token)]).encode("utf-8")
        return self._bytes[token]

    def separator(self) -> np.ndarray:
        return np.asarray([self.hf.token_to_id(END_OF_TEXT)], np.uint16)

    def to_dict(self) -> dict:
        bpe = json.loads(self.hf.to_str())
        return {"format": FORMAT, "kind": self.kind, "vocab": self.vocab, "bpe": bpe}


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet read back: each of its 256 characters -> its byte
    (printable bytes stand for themselves, the others for chr(256 + n) in byte order)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    table, n = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + n)] = byte
            n += 1
    return table


def require_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "the bpe tokenizer needs Hugging Face tokenizers: pip install 'mpihybrid[text]' "
            "(or --tokenizer byte, which needs nothing)"
        ) from None
    return tokenizers


def tokenizer_from_dict(data: dict, where: str) -> ByteTokenizer | BpeTokenizer:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DataError(f"{where}: not an mpihybrid tokenizer file")
    if data.get("kind") == "byte":
        return ByteTokenizer()
    if data.get("kind") == "bpe":
        tokenizers = require_tokenizers()
        try:
            return BpeTokenizer(tokenizers.Tokenizer.from_str(json.dumps(data["bpe"])))
        except (KeyError, Exception) as exc:
            raise DataError(f"{where}: its bpe tokenizer cannot be read ({exc})") from None
    raise DataError(f"{where}: unknown tokenizer kind {data.get('kind')!r}")


def load_tokenizer(path: str | os.PathLike) -> ByteTokenizer | BpeTokenizer:
    """A tokenizer.json (DataError with one line when it is missing or not ours)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"no tokenizer at {path}")
    try:
        data = json.loads(read_text(path, what="tokenizer", limit=MAX_TOKENIZER_BYTES))
    except InputFileError as exc:
        raise DataError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: unreadable tokenizer ({exc})") from None
    return tokenizer_from_dict(data, str(path))


def tokenizer_beside(pattern: str) -> Path:
    """Where the tokenizer of a token file (or glob of shards) lives: its directory."""
    return Path(pattern).parent / TOKENIZER_FILE


def check_one_tokenizer(sets: list[TokenShards]) -> None:
    """DataError naming two shards and their tokenizers when the shards of `sets` (data.train
    and data.val) lie beside different tokenizer.json files, or beside one and beside none: a
    token means another text in each, and training would mix them without a word."""
    first: dict[str | None, str] = {}  # the tokenizer's JSON -> the first shard beside it
    folders: set[Path] = set()
    for shards in sets:
        for path in shards.paths:
            if path.parent in folders:
                continue
            folders.add(path.parent)
            beside = path.parent / TOKENIZER_FILE
            if beside.exists():
                tokenizer = load_tokenizer(beside)
                key = json.dumps(tokenizer.to_dict(), sort_keys=True)
                what = f"{tokenizer.kind} tokenizer of {tokenizer.vocab} tokens, {beside}"
            else:
                key, what = None, f"no {TOKENIZER_FILE} beside it"
            here = f"{shards.where} shard {path} ({what})"
            if first and key not in first:
                other = next(iter(first.values()))
                raise DataError(
                    f"shards of two tokenizers: {other} and {here}; prepare them with one "
                    "tokenizer (mpihybrid data prepare)"
                )
            first.setdefault(key, here)
