"""Does one long run of text make the BPE trainer slow? `data prepare --tokenizer bpe`'s trainer
on generated text, the same bytes as one run and as 8-letter words, with and without the cut of
runs into pieces of MAX_RUN_BYTES (mpihybrid/nn/tokenizer.py).

    python benchmarks/bpe_long_runs.py                        # 4 MB: cut run vs words
    python benchmarks/bpe_long_runs.py --uncut-bytes 262144    # and the uncut trainer at 256 KB

Every case trains the same byte-level BPE of --vocab tokens on random lowercase letters (seed 0)
and encodes them back (checking the round trip); the ratio is each case's training time over the
words' (the reference: what the bytes cost when nothing is one long run).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mpihybrid.nn.tokenizer import BpeTokenizer


def letters(nbytes: int, words: bool) -> str:
    text = np.random.default_rng(0).integers(97, 123, nbytes, dtype=np.uint8).tobytes().decode()
    return " ".join(text[i : i + 8] for i in range(0, nbytes, 8)) if words else text


def timed(text: str, vocab: int, cut: bool) -> tuple[float, float, int]:
    """(train s, encode s, tokens) of one case."""
    start = time.perf_counter()
    tokenizer = BpeTokenizer.train([text], vocab, 1) if cut else _uncut(text, vocab)
    trained = time.perf_counter()
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    return trained - start, time.perf_counter() - trained, len(ids)


def _uncut(text: str, vocab: int) -> BpeTokenizer:
    """The trainer as it was: GPT-2's pre-tokenisation alone, no cut of long runs."""
    import tokenizers

    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator([text], trainer, length=1)
    return BpeTokenizer(hf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4_000_000, help="Size of the text.")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--uncut-bytes", type=int, default=0,
                        help="Also time the uncut trainer on one run of N bytes.")  # fmt: skip
    args = parser.parse_args()
    cases = [("words", args.bytes, True, True), ("one run, cut", args.bytes, False, True)]
    if args.uncut_bytes:
        cases += [("one run, cut", args.uncut_bytes, False, True),
                  ("one run, uncut", args.uncut_bytes, False, False)]  # fmt: skip
    reference: dict[int, float] = {}  # bytes -> the first case of that size
    print(f"{'case':<16} {'bytes':>10} {'train s':>8} {'encode s':>9} {'tokens':>10} {'ratio':>7}")
    for name, nbytes, words, cut in cases:
        train_s, encode_s, tokens = timed(letters(nbytes, words), args.vocab, cut)
        ratio = train_s / reference.setdefault(nbytes, train_s)
        print(f"{name:<16} {nbytes:>10,} {train_s:>8.2f} {encode_s:>9.2f} {tokens:>10,} "
              f"{ratio:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
