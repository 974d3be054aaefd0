"""The registry of model kinds: what the code knows of a kind of model, in one entry each.

    kind = model_kind(job.model.kind)       # KINDS["mlp"], KINDS["gpt"] or KINDS["llama"]
    kind.blocks(job.model, in_features, num_classes)
    kind.tokens_per_sample(job.data.seq_len)

A kind declares its blocks (the builder of its module: mlp.py, transformer.py), the data
kinds that feed it, whether a sample is a sequence of tokens (rows and throughput then count
tokens, the input is token ids), the blocks around the layers `model.partition` counts (a
GPT's embedding leads, its head trails), the shape of what crosses a pipeline boundary, the
rules its settings obey beyond the common ones, and the fused kernels its layers run
(nn/kernels.py). A third kind is its module of blocks plus one entry here (and its tests):
llama.py and LLAMA are one. A kind's `check` also refuses the settings of other kinds that
it does not read (model.kv_heads, model.tie_embeddings); whether a weights file starts it
(`init`: the file's check) and whether it splits its vocabulary (`vocab_parallel`) are its
entry's too, so nothing outside nn/ tests a kind by its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpihybrid.nn.layers import Layer
from mpihybrid.nn.llama import hf_export, llama_blocks, llama_check
from mpihybrid.nn.mlp import mlp_blocks
from mpihybrid.nn.transformer import gpt_blocks
from mpihybrid.nn.weights import config_of, export_tensors, init_problem

Block = list[Layer]


@dataclass(frozen=True)
class ModelKind:
    name: str
    blocks: Callable[..., list[Block]]  # (model cfg, in_features, num_classes) -> blocks
    data_kinds: tuple[str, ...]  # data.kind values that feed it
    tokens: bool  # a sample is data.seq_len tokens: rows are samples x tokens, input is ids
    # per sample, the activation a chunk past the first receives: (model cfg, in_features,
    # the chunk's first layer) -> shape without the batch
    activation: Callable[..., tuple[int, ...]]
    check: Callable[..., str]  # model cfg -> what is wrong with it, in one line ("" = nothing)
    kernels: Callable[..., tuple[str, ...]]  # model cfg -> nn/kernels.py functions its layers run
    lead: tuple[str, ...] = ()  # blocks before the layers model.partition counts
    trail: tuple[str, ...] = ()  # blocks after them
    # `weights export`: (the model's stages in order, model cfg, seq_len, vocab) -> (tensors by
    # name, the config the file carries); None: the kind has no file format
    export: Callable[..., tuple[dict, dict]] | None = None
    # model.init: (model cfg, seq_len, vocab) -> what is wrong with the file for this model, in
    # one line ("" = it fits); None: no file starts this kind
    init: Callable[..., str] | None = None
    vocab_parallel: bool = False  # model.vocab_parallel: table and head split by vocabulary

    def tokens_per_sample(self, seq_len: int) -> int:
        """What one sample counts in rows and throughput: its tokens, or itself."""
        return seq_len if self.tokens else 1

    def input_width(self, in_features: int) -> int:
        """Features of the model's input per row (token ids carry none)."""
        return 0 if self.tokens else in_features

    @property
    def ends(self) -> tuple[str, ...]:
        """The blocks that ride with the first and last chunk (a chunk may hold only them)."""
        return self.lead + self.trail


_LAYERNORM = ("layernorm_forward", "layernorm_backward_input", "layernorm_backward_weight")


def _mlp_kernels(cfg) -> tuple[str, ...]:
    gelu = ("gelu_forward", "gelu_backward") if cfg.activation == "gelu" else ()
    return gelu + (_LAYERNORM if cfg.norm else ())


def _no_kv_heads(cfg) -> str:
    if getattr(cfg, "kv_heads", 0):
        return (
            f"model.kv_heads = {cfg.kv_heads}: a llama's setting (model.kind = {cfg.kind!r} has "
            "no grouped-query attention)"
        )
    return ""


def _mlp_check(cfg) -> str:
    if getattr(cfg, "tie_embeddings", False):  # a token model's table (V, C) is its head's W.T
        return (
            f"model.tie_embeddings: a gpt's or a llama's (model.kind = {cfg.kind!r}: its first "
            "layer and its head have different shapes)"
        )
    return _no_kv_heads(cfg)


def _gpt_export(stages: list, cfg, seq_len: int, vocab: int) -> tuple[dict, dict]:
    return export_tensors(stages, cfg.depth + 2), config_of(cfg, seq_len, vocab)


def _gpt_check(cfg) -> str:
    if cfg.hidden % cfg.heads:
        return f"model.hidden({cfg.hidden}) is not divisible by model.heads({cfg.heads})"
    return _no_kv_heads(cfg)


MLP = ModelKind(
    name="mlp",
    blocks=mlp_blocks,
    data_kinds=("teacher",),
    tokens=False,
    activation=lambda cfg, in_features, first: (first.in_features,),
    check=_mlp_check,
    kernels=_mlp_kernels,
)

GPT = ModelKind(
    name="gpt",
    blocks=gpt_blocks,
    data_kinds=("random-tokens", "markov", "tokens"),
    tokens=True,
    activation=lambda cfg, seq_len, first: (seq_len, cfg.hidden),
    check=_gpt_check,
    kernels=lambda cfg: (
        *_LAYERNORM,
        "bias_gelu_forward",
        "gelu_backward",
        "softmax_causal_forward",
        "softmax_causal_backward",
        "bias_residual_add",
        "embedding_backward",
    ),
    lead=("embedding",),
    trail=("head",),
    export=_gpt_export,  # nanoGPT's names (nn/weights.py)
    init=init_problem,  # a nanoGPT-named file (weights export's, or nanoGPT's own)
    vocab_parallel=True,  # nn/vocab.py
)

LLAMA = ModelKind(
    name="llama",
    blocks=llama_blocks,
    data_kinds=GPT.data_kinds,
    tokens=True,
    activation=GPT.activation,
    check=llama_check,
    kernels=lambda cfg: (
        "softmax_causal_forward",
        "softmax_causal_backward",
        "embedding_backward",
    ),
    lead=GPT.lead,
    trail=GPT.trail,
    export=hf_export,  # Hugging Face's LlamaForCausalLM names
)

KINDS = {kind.name: kind for kind in (MLP, GPT, LLAMA)}


def model_kind(name: str) -> ModelKind:
    """The registered kind called `name`; ValueError naming the known ones otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"model.kind = {name!r}: choose one of {', '.join(KINDS)}") from None


def kinds_with(fact: str) -> str:
    """The kinds that have `fact` (a ModelKind field: init, vocab_parallel), for a line that
    refuses it to another kind: "a gpt", or "a gpt or a llama"."""
    return " or ".join(f"a {k.name}" for k in KINDS.values() if getattr(k, fact))
