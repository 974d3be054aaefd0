"""model.vocab_parallel's weights as the whole model's: every chunk's flat parameters (the
stages', then the vocabulary shares' in rank order) -> nanoGPT-named tensors (nn/weights.py), and
a share's rows from a whole file (model.init: split on load).

    tensors = whole_tensors(cfg, in_features, vocab, flats, pp)   # {"transformer.wte.weight": ..}
    stage = whole_model(cfg, in_features, vocab, flats, pp, seed=seed)  # unsplit, one stage
    load_share(shard_layer, path)                                  # its rows of wte and the head
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mpihybrid.nn.model import Stage, build_stage
from mpihybrid.nn.vocab import VocabShard, shard_tensors, share_layer
from mpihybrid.nn.weights import HEAD, HEAD_BIAS, WTE, export_tensors, fill


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
        layer = share_layer(cfg, in_features, vocab, pp, r, seed=0)
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


def whole_model(cfg, in_features: int, vocab: int, flats: list, pp: int, *, seed: int) -> Stage:
    """The unsplit model as one stage holding the run's weights (export, generate); a tied
    head is bound to the table by the caller (train.tie.bind_local)."""
    tensors = whole_tensors(cfg, in_features, vocab, flats, pp)
    stage = build_stage(unsplit(cfg), in_features, vocab, 0, 1, seed=seed)
    fill(stage, tensors.__getitem__, set(tensors), cfg.depth + 2)
    return stage


def load_share(layer: VocabShard, path) -> None:
    """A share's rows of wte, columns of lm_head (wte's where the file has none: tied) and of
    its bias (zeros where none: nanoGPT's) from a whole-model file."""
    from safetensors import safe_open

    lo, n = layer.lo, layer.real
    with safe_open(str(path), framework="numpy") as f:
        keys = set(f.keys())
        layer.params["tokens"][:n] = f.get_tensor(WTE)[lo : lo + n]
        if not layer.tied:
            head = f.get_tensor(HEAD if HEAD in keys else WTE)  # (V, C), nanoGPT's layout
            layer.params["head"][:, :n] = head[lo : lo + n].T
        if HEAD_BIAS in keys:
            layer.params["bias"][:n] = f.get_tensor(HEAD_BIAS)[lo : lo + n]
        else:
            layer.params["bias"][...] = 0.0
