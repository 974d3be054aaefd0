"""model.vocab_parallel's weights as the whole model's: every chunk's flat parameters (the
stages', then the vocabulary shares' in rank order) -> nanoGPT-named tensors (nn/weights.py).

    tensors = whole_tensors(cfg, in_features, vocab, flats, seed)   # {"transformer.wte.weight": ..}
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mpihybrid.nn.model import Stage, build_stage
from mpihybrid.nn.vocab import VocabShard, shard_tensors
from mpihybrid.nn.weights import HEAD, HEAD_BIAS, WTE, export_tensors


def whole_tensors(cfg, in_features: int, vocab: int, flats: list, pp: int) -> dict:
    """flats: the num_stages stages' flat parameters, then the pp shares' (Summary.params of a
    vocab_parallel run): the whole model's tensors, gathered, padding dropped."""
    num_stages = len(flats) - pp
    num_blocks = cfg.depth + 2
    stages = []
    for s in range(num_stages):
        st = build_stage(cfg, in_features, vocab, s, num_stages, seed=0)
        st.flat_params[...] = flats[s]
        stages.append(st)
    shards = []
    for r in range(pp):
        layer = VocabShard(vocab, pp, r, in_features, cfg.hidden, tied=cfg.tie_embeddings,
                           seed=0, num_blocks=num_blocks)  # fmt: skip
        st = Stage([[layer]], 0, 0)
        st.flat_params[...] = flats[num_stages + r]
        shards.append(layer)
    out = export_tensors(stages, num_blocks)
    whole = shard_tensors(shards, cfg.tie_embeddings)
    out[WTE] = np.ascontiguousarray(whole["tokens"])
    out[HEAD] = np.ascontiguousarray(whole["head"].T)  # nanoGPT's (out, in)
    out[HEAD_BIAS] = whole["bias"]
    return out


def unsplit(cfg):
    """The same model without vocab_parallel (the serial reference's)."""
    return dataclasses.replace(cfg, vocab_parallel=False)
