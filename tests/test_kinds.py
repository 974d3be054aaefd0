"""The registry of model kinds: each kind declares what the rest of the code asks of it, and a
kind added to the registry alone is one the job, the model split and the cost model take."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from mpihybrid.config import ConfigError, build_job, resolve
from mpihybrid.nn import kernels
from mpihybrid.nn.cost import microbatch_rows, stage_work
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.kinds import KINDS, ModelKind, model_kind
from mpihybrid.nn.layers import Linear
from mpihybrid.nn.loss import SoftmaxCrossEntropy
from mpihybrid.nn.model import boundary_shapes, build_blocks, build_stage, layer_counts
from mpihybrid.nn.settings import Setting


def test_the_registered_kinds():
    assert list(KINDS) == ["mlp", "gpt", "llama"]
    assert model_kind("mlp").data_kinds == ("teacher",)
    assert model_kind("gpt").data_kinds == ("random-tokens", "markov", "tokens")
    assert model_kind("gpt").tokens_per_sample(64) == 64
    assert model_kind("mlp").tokens_per_sample(64) == 1
    assert model_kind("gpt").ends == ("embedding", "head") and model_kind("mlp").ends == ()
    with pytest.raises(ValueError, match="model.kind = 'cnn': choose one of mlp, gpt, llama"):
        model_kind("cnn")


@pytest.mark.parametrize(
    "sets",
    [
        ["model.kind=gpt", "data.kind=markov", "model.hidden=16", "model.heads=2"],
        ["model.kind=llama", "data.kind=markov", "model.hidden=16", "model.heads=2"],
        ["model.activation=gelu", "model.norm=true"],
        ["model.activation=relu", "model.norm=false"],
    ],
)
def test_every_declared_kernel_is_one_of_nn_kernels(sets):
    job = build_job({}, sets)
    names = model_kind(job.model.kind).kernels(job.model)
    assert all(callable(getattr(kernels, name, None)) for name in names), names
    # what the layers take: a GELU or a LayerNorm (every GPT has both) has kernels, ReLU none
    layers = {type(layer).__name__ for block in build_blocks(job.model, 8, 4) for layer in block}
    assert bool(names) == bool(layers & {"GELU", "LayerNorm", "Residual"})


def test_job_answers_microbatch_size_and_tokens_per_sample():
    sets = ["model.kind=gpt", "data.kind=markov", "model.hidden=16", "model.heads=2"]
    sets += ["data.seq_len=8", "train.global_batch=24", "train.microbatches=3", "grid.pp=2"]
    gpt = resolve(build_job({}, sets), 4)
    assert gpt.microbatch_size == 24 // (2 * 3) and gpt.tokens_per_sample == 8
    assert microbatch_rows(gpt.workload) == (4, 32)
    mlp = resolve(build_job({}, ["train.global_batch=24", "train.microbatches=2"]), 3)
    assert mlp.microbatch_size == 4 and mlp.tokens_per_sample == 1
    assert microbatch_rows(mlp.workload) == (4, 4)


def _linear_blocks(cfg, in_features: int, num_classes: int):
    """A third kind, as its own module would write it: `depth` Linear layers, no activation."""
    widths = [in_features] + [cfg.hidden] * (cfg.depth - 1) + [num_classes]
    return [[Linear(a, b)] for a, b in zip(widths[:-1], widths[1:], strict=True)]


LINEAR = ModelKind(
    name="linear",
    blocks=_linear_blocks,
    data_kinds=("teacher",),
    tokens=False,
    activation=lambda cfg, in_features, first: (first.in_features,),
    check=lambda cfg: "" if cfg.hidden >= 2 else f"model.hidden({cfg.hidden}) < 2",
    kernels=lambda cfg: (),
    loss=lambda: HalvedLoss(),
)


class HalvedLoss(SoftmaxCrossEntropy):
    """A loss of the third kind's own: half the cross-entropy, so its numbers are told apart."""

    def forward(self, logits, targets):
        loss, cache = super().forward(logits, targets)
        return loss / 2, cache

    def nats(self, logits, targets):
        return super().nats(logits, targets) / 2


def test_a_third_kind_is_one_entry(monkeypatch):
    monkeypatch.setitem(KINDS, "linear", LINEAR)
    sets = ["model.kind=linear", "model.depth=4", "model.hidden=6", "data.features=5"]
    sets += ["grid.pp=2", "train.global_batch=8", "train.microbatches=2"]
    job = resolve(build_job({}, sets), 2)
    blocks = build_blocks(job.model, *task_dims(job.data))
    assert [b[0].param_shapes()["weight"] for b in blocks] == [(5, 6), (6, 6), (6, 6), (6, 2)]
    assert boundary_shapes(job.model, 5, 2, 2, 4) == [(4, 5), (4, 6)]
    assert layer_counts(job.model, [range(0, 2), range(2, 4)]) == [2, 2]
    assert [w.params for w in stage_work(job.workload)] == [
        5 * 6 + 6 + 6 * 6 + 6,
        6 * 6 + 6 + 6 * 2 + 2,
    ]
    stage = build_stage(job.model, 5, 2, 1, 2, seed=0)
    y, _ = stage.forward(np.ones((4, 6), np.float32))
    assert y.shape == (4, 2)
    assert isinstance(job.runtime_settings().loss(), HalvedLoss)  # the last stage's loss
    with pytest.raises(ConfigError, match=r"model.hidden\(1\) < 2"):
        resolve(build_job({}, [*sets, "model.hidden=1"]), 2)
    with pytest.raises(ConfigError, match="data.kind = 'markov': unknown; choose one of teacher"):
        resolve(build_job({}, [*sets, "data.kind=markov"]), 2)


def _kind_tests(source: str) -> list[str]:
    """Every comparison of a value with a kind's name ("gpt", "llama", "mlp") in `source`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            names = [node.left, *node.comparators]
            found += [n.value for n in names if isinstance(n, ast.Constant) and n.value in KINDS]
    return found


def test_no_kind_is_tested_by_name_outside_nn():
    """What a kind is or allows (ties, a file to start from, a split vocabulary, the way across
    a checkpoint's chunks) is asked of its entry in nn/kinds.py, not of its name."""
    from tests.helpers import ROOT

    package = ROOT / "mpihybrid"
    wrong = [
        f"{path.relative_to(ROOT)}: {', '.join(found)}"
        for path in sorted(package.rglob("*.py"))
        if (package / "nn") not in path.parents and (found := _kind_tests(path.read_text()))
    ]
    assert not wrong, "a model kind tested by name outside nn/:\n" + "\n".join(wrong)
    assert _kind_tests('if m.kind != "gpt" or "llama" == k:\n    pass') == ["gpt", "llama"]


def test_the_kind_says_where_its_tied_pair_sits():
    """model.tie_embeddings: the table is the first block's first layer, the head the last
    block's last layer, found among any chunks given; a kind without a Tie, an untied job and a
    vocabulary split (its shares tie themselves) have no pair."""
    tokens = ["data.kind=markov", "model.hidden=16", "model.heads=2", "model.depth=2"]
    for kind in ("gpt", "llama"):
        job = build_job({}, [f"model.kind={kind}", *tokens, "model.tie_embeddings=true"])
        chunks = [build_stage(job.model, *task_dims(job.data), c, 3, seed=0) for c in range(3)]
        entry = model_kind(kind)
        assert entry.tied_pair(job.model, chunks) == (chunks[0].layers[0], chunks[2].layers[-1])
        assert entry.tied_pair(job.model, chunks[1:]) == (None, chunks[2].layers[-1])
        assert chunks[2].layers[-1].tied and entry.tie.param in chunks[0].layers[0].params
        untied = build_job({}, [f"model.kind={kind}", *tokens])
        assert entry.tied_pair(untied.model, chunks) == (None, None)
    split = build_job({}, ["model.kind=gpt", *tokens, "model.tie_embeddings=true",
                           "model.vocab_parallel=true"])  # fmt: skip
    assert model_kind("gpt").tied_pair(split.model, []) == (None, None)
    assert model_kind("mlp").tie is None and not model_kind("mlp").ties(build_job({}, []).model)


def test_a_kinds_settings_are_its_own(monkeypatch):
    """[model] is every kind's keys and each kind's own, declared in its module: a new kind's
    setting is a key of the section with its default and its check, and another kind's key
    is refused naming the kinds that read it."""
    from mpihybrid.config.job import model_config_class

    kind = dataclasses.replace(LINEAR, settings=(Setting("slope", 1.0, "its own", low=0),))
    monkeypatch.setitem(KINDS, "linear", kind)
    cls = model_config_class()
    assert cls().slope == 1.0 and cls(kind="linear", slope=2.0).slope == 2.0
    assert (
        kind.settings_problem(cls(kind="linear", slope=-1.0)) == "model.slope = -1.0: must be >= 0"
    )
    assert model_kind("gpt").settings_problem(cls(kind="gpt", slope=2.0)) == (
        "model.slope = 2.0: a linear's setting (model.kind = 'gpt' does not read it)"
    )
    assert kind.settings_problem(cls(kind="linear", kv_heads=2)).startswith(
        "model.kv_heads = 2: a llama's setting"
    )
    assert kind.settings_problem(cls(kind="linear", tie_embeddings=True)).startswith(
        "model.tie_embeddings = true: a gpt's or a llama's setting"  # the kinds with a Tie
    )
    tying = dataclasses.replace(kind, tie=model_kind("gpt").tie)
    with pytest.raises(ValueError, match="reads model.tie_embeddings iff it ties"):
        model_config_class({"linear": tying})
    other = dataclasses.replace(kind, settings=(Setting("heads", 8, "eight"),))
    with pytest.raises(ValueError, match="model.heads: two defaults"):
        model_config_class({**KINDS, "linear": other})


def test_the_job_names_no_kind_and_docs_name_each_settings_readers():
    """config/job.py makes [model] from the registry; docs/jobs.md's row of each kind's setting
    names every kind that reads it."""
    from mpihybrid.nn.kinds import kind_settings
    from tests.helpers import ROOT

    text = (ROOT / "mpihybrid" / "config" / "job.py").read_text()
    assert [k for k in KINDS if re.search(rf"\b{k}\b", text, re.I)] == []
    lines = (ROOT / "docs" / "jobs.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| `")}
    for key in kind_settings():
        row = rows[f"`model.{key}`"]
        missing = [k.name for k in KINDS.values() if k.reads(key) and k.name not in row]
        assert not missing, f"docs/jobs.md's model.{key} row does not name {missing}"
