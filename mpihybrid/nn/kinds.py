"""The registry of model kinds: what the code knows of a kind of model, in one entry each.

    kind = model_kind(job.model.kind)       # KINDS["mlp"], KINDS["gpt"] or KINDS["llama"]
    kind.build(job.model, in_features, num_classes)  # its blocks (tied if the job ties)
    kind.loss()                                       # its last stage's loss
    kind.tokens_per_sample(job.data.seq_len)

A kind declares its blocks (the builder of its module: mlp.py, transformer.py), the data
kinds that feed it, whether a sample is a sequence of tokens (rows and throughput then count
tokens, the input is token ids), the blocks around the layers `model.partition` counts (a
GPT's embedding leads, its head trails), the shape of what crosses a pipeline boundary, its
settings (the model.* keys it reads beyond every kind's, declared in its module: nn/settings.py;
config/job.py makes [model] of every kind's, and `settings_problem` refuses another kind's key
naming the kinds that read it), the rules its settings obey together, and the fused kernels its
layers run (nn/kernels.py). A new kind is its module (blocks and settings) plus one entry here
and its tests. What its safetensors file holds (`weights`: `weights export` writes it,
`model.init` checks it and each stage loads its own blocks from it), the loss its last stage
computes (`loss`: the runtime's, evaluation's and profiles') and where its tied pair sits
(`tie`: train/tie.py asks `tied_pair`) are its entry's too, so nothing outside nn/ tests a kind
by its name or probes its layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpihybrid.nn.layers import Layer
from mpihybrid.nn.llama import LLAMA_SETTINGS, llama_blocks, llama_check
from mpihybrid.nn.llama_weights import hf_check, hf_export, hf_load
from mpihybrid.nn.loss import SoftmaxCrossEntropy
from mpihybrid.nn.mlp import MLP_SETTINGS, mlp_blocks
from mpihybrid.nn.settings import Setting, toml_text
from mpihybrid.nn.transformer import GPT_SETTINGS, gpt_blocks
from mpihybrid.nn.weights import config_of, export_tensors, init_problem, load_into

Block = list[Layer]


@dataclass(frozen=True)
class Tie:
    """Where a kind's tied pair sits (model.tie_embeddings): the token table (V, C) is parameter
    `param` of the first layer of the model's first block, the head is the last layer of its
    last block (a Linear(tied=True): its weight is the table, transposed; train/tie.py)."""

    param: str = "tokens"

    def table(self, stages) -> Layer | None:
        """The table's layer, from the stage holding the model's first block (if given)."""
        return next((st.blocks[0][0] for st in stages if st.block_range.start == 0), None)

    def head(self, stages, num_blocks: int) -> Layer | None:
        """The head, from the stage holding the model's last block (of `num_blocks`)."""
        return next((st.blocks[-1][-1] for st in stages if st.block_range.stop == num_blocks), None)


TOKEN_TABLE = Tie()  # gpt's and llama's: the embedding leads, the head trails


@dataclass(frozen=True)
class WeightsFile:
    """What a kind's safetensors file holds: `weights export` writes the whole model under the
    kind's names with its config, `model.init` checks a file against the job's model (on every
    rank, before any message) and each stage loads its own blocks' tensors from it."""

    names: str  # whose names and layouts the tensors follow
    # (the model's stages in order, model cfg, seq_len, vocab) -> (tensors by name, its config)
    export: Callable[..., tuple[dict, dict]]
    # (model cfg, seq_len, vocab) -> what keeps cfg.init's file from starting this model, in one
    # line ("" = it fits)
    check: Callable[..., str]
    load: Callable[..., None]  # (stage, model cfg): its parameters from cfg.init's file


@dataclass(frozen=True)
class ModelKind:
    name: str
    blocks: Callable[..., list[Block]]  # (model cfg, in_features, num_classes) -> blocks
    data_kinds: tuple[str, ...]  # data.kind values that feed it
    tokens: bool  # a sample is data.seq_len tokens: rows are samples x tokens, input is ids
    # per sample, the activation a chunk past the first receives: (model cfg, in_features,
    # the chunk's first layer) -> shape without the batch
    activation: Callable[..., tuple[int, ...]]
    # model cfg -> what is wrong with its settings together, in one line ("" = nothing)
    check: Callable[..., str]
    kernels: Callable[..., tuple[str, ...]]  # model cfg -> nn/kernels.py functions its layers run
    # makes the loss its last stage computes (the pipeline runtime's, evaluation's, profiles')
    loss: Callable[[], SoftmaxCrossEntropy]
    lead: tuple[str, ...] = ()  # blocks before the layers model.partition counts
    trail: tuple[str, ...] = ()  # blocks after them
    # `weights export` and model.init: its file's names, written and read; None: it has none
    weights: WeightsFile | None = None
    tie: Tie | None = None  # model.tie_embeddings: where its tied pair sits; None: it cannot tie
    settings: tuple[Setting, ...] = ()  # the model.* keys it reads beyond every kind's

    def reads(self, key: str) -> bool:
        """Whether model.`key`, a setting of some kind's, is one of this kind's."""
        return any(s.name == key for s in self.settings)

    @property
    def vocab_parallel(self) -> bool:
        """Whether it can split its table and head by vocabulary (model.vocab_parallel)."""
        return self.reads("vocab_parallel")

    def settings_problem(self, cfg) -> str:
        """What is wrong with the model section's kind settings, in one line ("" = nothing):
        another kind's key away from its default (naming the kinds that read it), then each of
        this kind's against its own check."""
        for key, setting in kind_settings().items():
            value = getattr(cfg, key)
            if not self.reads(key) and value != setting.default:
                return (
                    f"model.{key} = {toml_text(value)}: {readers(key)} setting (model.kind = "
                    f"{self.name!r} does not read it)"
                )
        return next((p for s in self.settings if (p := s.problem(getattr(cfg, s.name)))), "")

    def ties(self, cfg) -> bool:
        """Whether this model's head computes with its token table (model.tie_embeddings)."""
        return self.tie is not None and bool(cfg.tie_embeddings)

    def stages_tie(self, cfg) -> bool:
        """Whether the stages carry the tie (train/tie.py: the head's rank mirrors the table):
        a tied model whose vocabulary is not split (model.vocab_parallel: the shares hold one
        matrix each, nn/vocab.py)."""
        return self.ties(cfg) and not (self.vocab_parallel and cfg.vocab_parallel)

    def build(self, cfg, in_features: int, num_classes: int) -> list[Block]:
        """The model's blocks; a kind that ties is told whether this one does."""
        if self.tie is None:
            return self.blocks(cfg, in_features, num_classes)
        return self.blocks(cfg, in_features, num_classes, tied=self.ties(cfg))

    def tied_pair(self, cfg, stages) -> tuple[Layer | None, Layer | None]:
        """model.tie_embeddings: (the layer holding the token table, the tied head) among
        `stages` (some of the model's chunks), each None where no stage holds it; (None, None)
        where the stages carry no tie (stages_tie)."""
        if not self.stages_tie(cfg):
            return None, None
        return self.tie.table(stages), self.tie.head(stages, len(self.ends) + cfg.depth)

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


def _gpt_export(stages: list, cfg, seq_len: int, vocab: int) -> tuple[dict, dict]:
    return export_tensors(stages, cfg.depth + 2), config_of(cfg, seq_len, vocab)


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
    check=lambda cfg: "",  # its settings are independent
    kernels=_mlp_kernels,
    loss=SoftmaxCrossEntropy,  # over the classes
    settings=MLP_SETTINGS,
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
    loss=SoftmaxCrossEntropy,  # next-token, over the vocabulary
    lead=("embedding",),
    trail=("head",),
    # a nanoGPT-named file (weights export's, or nanoGPT's own; nn/weights.py)
    weights=WeightsFile(
        names="nanoGPT's",
        export=_gpt_export,
        check=init_problem,
        load=lambda stage, cfg: load_into(stage, cfg.init, cfg.depth + 2),
    ),
    tie=TOKEN_TABLE,  # nanoGPT's wte = lm_head
    settings=GPT_SETTINGS,  # model.vocab_parallel among them: nn/vocab.py
)

LLAMA = ModelKind(
    name="llama",
    blocks=llama_blocks,
    data_kinds=GPT.data_kinds,
    tokens=True,
    activation=GPT.activation,
    check=llama_check,
    kernels=lambda cfg: (
        "rmsnorm_forward",
        "rmsnorm_backward_input",
        "rmsnorm_backward_weight",
        "swiglu_forward",
        "swiglu_backward",
        "rotary_pack",
        "rotary_unpack",
        "softmax_causal_forward",
        "softmax_causal_backward",
        "embedding_backward",
    ),
    loss=GPT.loss,
    lead=GPT.lead,
    trail=GPT.trail,
    weights=WeightsFile(  # nn/llama_weights.py
        names="Hugging Face's LlamaForCausalLM", export=hf_export, check=hf_check, load=hf_load
    ),
    tie=TOKEN_TABLE,  # Hugging Face's tie_word_embeddings
    settings=LLAMA_SETTINGS,
)

KINDS = {kind.name: kind for kind in (MLP, GPT, LLAMA)}
DEFAULT_KIND = MLP.name  # model.kind left out


def model_kind(name: str) -> ModelKind:
    """The registered kind called `name`; ValueError naming the known ones otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"model.kind = {name!r}: choose one of {', '.join(KINDS)}") from None


def kinds_with(fact: str) -> str:
    """The kinds that have `fact` (a ModelKind field: weights, vocab_parallel), for a line that
    refuses it to another kind: "a gpt", or "a gpt or a llama"."""
    return " or ".join(f"a {k.name}" for k in KINDS.values() if getattr(k, fact))


def readers(key: str) -> str:
    """The kinds whose settings hold model.`key`, for the line that refuses it to another:
    "a gpt's or a llama's"."""
    return " or ".join(f"a {k.name}'s" for k in KINDS.values() if k.reads(key))


def kind_settings(kinds=None) -> dict[str, Setting]:
    """Every kind's settings by key, in the registry's order (config/job.py makes [model] of
    them). A key two kinds read has one default; a kind reads tie_embeddings where it has a
    Tie. ValueError for a registry that breaks either."""
    merged: dict[str, Setting] = {}
    for kind in (KINDS if kinds is None else kinds).values():
        if kind.reads("tie_embeddings") != (kind.tie is not None):
            raise ValueError(f"model.kind {kind.name!r}: reads model.tie_embeddings iff it ties")
        for s in kind.settings:
            if merged.setdefault(s.name, s).default != s.default:
                raise ValueError(f"model.{s.name}: two defaults ({kind.name!r}'s {s.default!r})")
    return merged
