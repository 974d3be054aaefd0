"""The registry of model kinds: what the code knows of a kind of model, in one entry each.

    kind = model_kind(job.model.kind)       # KINDS["mlp"] or KINDS["gpt"]
    kind.blocks(job.model, in_features, num_classes)
    kind.tokens_per_sample(job.data.seq_len)

A kind declares its blocks (the builder of its module: mlp.py, transformer.py), the data
kinds that feed it, whether a sample is a sequence of tokens (rows and throughput then count
tokens, the input is token ids), the blocks around the layers `model.partition` counts (a
GPT's embedding leads, its head trails), the shape of what crosses a pipeline boundary, the
rules its settings obey beyond the common ones, and the fused kernels its layers run
(nn/kernels.py). A third kind is its module of blocks plus one entry here (and its tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpihybrid.nn.layers import Layer
from mpihybrid.nn.mlp import mlp_blocks
from mpihybrid.nn.transformer import gpt_blocks

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


def _gpt_check(cfg) -> str:
    if cfg.hidden % cfg.heads:
        return f"model.hidden({cfg.hidden}) is not divisible by model.heads({cfg.heads})"
    return ""


MLP = ModelKind(
    name="mlp",
    blocks=mlp_blocks,
    data_kinds=("teacher",),
    tokens=False,
    activation=lambda cfg, in_features, first: (first.in_features,),
    check=lambda cfg: "",
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
)

KINDS = {kind.name: kind for kind in (MLP, GPT)}


def model_kind(name: str) -> ModelKind:
    """The registered kind called `name`; ValueError naming the known ones otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"model.kind = {name!r}: choose one of {', '.join(KINDS)}") from None
