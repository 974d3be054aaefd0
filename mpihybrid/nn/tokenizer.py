"""Tokenizers that turn text into token files and tokens back into text: one JSON file,
`tokenizer.json`, beside the token files (and in every checkpoint of a run trained on them).

    byte  a token per UTF-8 byte: vocabulary 256, no dependency, bits/token = bits/byte
    bpe   byte-level BPE trained on the corpus by Hugging Face `tokenizers`
          (pip install 'mpihybrid[text]'); its own JSON is kept inside ours

    {"format": "mpihybrid-tokenizer", "kind": "byte" | "bpe", "vocab": N, "bpe": {...}}
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from mpihybrid.inputs import InputFileError, MiB, read_text
from mpihybrid.nn.tokens import DataError

TOKENIZER_FILE = "tokenizer.json"
FORMAT = "mpihybrid-tokenizer"
END_OF_TEXT = "<|endoftext|>"  # bpe: between documents (token 0)
MAX_TOKENIZER_BYTES = 64 * MiB  # a bpe of 65536 tokens is a few MiB of JSON


class ByteTokenizer:
    kind = "byte"
    vocab = 256
    bytes_per_token = 1.0  # every token is one byte: bits/byte = bits/token

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)

    def decode(self, tokens: Iterable[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")

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

    @classmethod
    def train(cls, texts: Iterable[str], vocab: int, length: int | None = None) -> BpeTokenizer:
        """Byte-level BPE (GPT-2's pre-tokenisation) with `vocab` tokens, trained on texts."""
        tokenizers = require_tokenizers()
        hf = tokenizers.Tokenizer(tokenizers.models.BPE())
        hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
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

    def separator(self) -> np.ndarray:
        return np.asarray([self.hf.token_to_id(END_OF_TEXT)], np.uint16)

    def to_dict(self) -> dict:
        bpe = json.loads(self.hf.to_str())
        return {"format": FORMAT, "kind": self.kind, "vocab": self.vocab, "bpe": bpe}


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
