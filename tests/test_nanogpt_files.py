"""nanoGPT's files and recipe (issue 53): a bias = False checkpoint starts a run through
model.init (every bias zero, said once); model.gelu = "erf" is nanoGPT's exact GELU, "tanh"
(GPT-2's) stays the default and an export says which."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors is not installed (the weights extra)")
from safetensors.numpy import save_file  # noqa: E402

from mpihybrid.config import ConfigError  # noqa: E402
from mpihybrid.nn import weights as nw  # noqa: E402
from mpihybrid.nn.gelu import GELUErf  # noqa: E402
from mpihybrid.nn.layers import GELU  # noqa: E402
from mpihybrid.nn.transformer import gpt_blocks  # noqa: E402
from tests.test_weights import job, stages, whole  # noqa: E402


def test_a_bias_false_nanogpt_file_loads_with_zero_biases(tmp_path, caplog):
    source = stages(job(), 1, 0)
    flat = source[0].flat_params  # every parameter drawn, the biases too (they start at zero)
    flat[...] = np.random.default_rng(0).standard_normal(flat.shape).astype(flat.dtype)
    tensors = nw.export_tensors(source, 5)
    kept = {k: v for k, v in tensors.items() if not k.endswith(".bias")}
    assert len(kept) < len(tensors) and nw.biasless(kept)
    path = tmp_path / "nano.safetensors"
    save_file(kept, str(path))
    j = job(f"model.init={path}")  # accepted, not "not a GPT of this job's model"
    (target,) = stages(j, 1, 7)
    nw.load_into(target, path, 5)
    zeros = {k: np.zeros_like(v) if k.endswith(".bias") else v for k, v in tensors.items()}
    full = tmp_path / "zero_biases.safetensors"
    save_file(zeros, str(full))
    (expected,) = stages(job(), 1, 9)
    nw.load_into(expected, full, 5)
    np.testing.assert_array_equal(whole([target]), whole([expected]))
    assert whole([target]).any() and not np.array_equal(whole([target]), whole(source))
    with caplog.at_level(logging.INFO, logger="mpihybrid"):
        assert nw.nonfinite_problem(path) == ""
    said = [r for r in caplog.records if "bias = False" in r.getMessage()]
    assert len(said) == 1


def test_gelu_erf_is_the_exact_gelu_and_tanh_stays_the_default():
    x = np.linspace(-7, 7, 20001).astype(np.float32)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    layer = GELUErf()
    y, cache = layer.forward(x)
    print("max |GELU erf - math.erf's|", np.abs(y - exact).max())
    assert np.abs(y - exact).max() < 2e-6
    dx, _ = layer.backward_input(np.ones_like(x), cache)
    h = 1e-4
    up = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64) + h])
    down = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64) - h])
    assert np.abs(dx - (up - down) / (2 * h)).max() < 1e-5
    tanh_y, _ = GELU().forward(x)
    assert np.abs(tanh_y - exact).max() > 1e-4  # the two forms differ: the setting matters
    assert job().model.gelu == "tanh"
    for form, kind in (("tanh", GELU), ("erf", GELUErf)):
        j = job(f"model.gelu={form}")
        blocks = gpt_blocks(j.model, j.data.seq_len, j.data.vocab)
        mlp = blocks[1][1].branch
        assert type(mlp[2]) is kind
        assert nw.config_of(j.model, j.data.seq_len, j.data.vocab)["gelu"] == form
    with pytest.raises(ConfigError, match="model.gelu"):
        job("model.gelu=exact")


def test_weight_decay_reaches_the_matrices_only_by_default():
    from mpihybrid.nn.optim import AdamW, ShardedOptimizer, decay_pieces
    from mpihybrid.train.state import decayed_ranges

    j = job("train.optimizer=adamw", "train.weight_decay=0.5", "train.lr=0.1")
    assert j.train.weight_decay_on == "matrices"
    (stage,) = stages(j, 1, 0)
    names = {}
    for layer in stage.layers:
        for name, shape in layer.param_shapes().items():
            names.setdefault(len(shape), []).append((type(layer).__name__, name))
    ranges = decayed_ranges(stage, "matrices")
    with_tables = decayed_ranges(stage, "matrices+embeddings")
    assert decayed_ranges(stage, "all") is None
    table = sum(hi - lo for lo, hi in with_tables) - sum(hi - lo for lo, hi in ranges)
    assert table == (37 + 8) * 16  # wte (V, C) and wpe (T, C)
    # zero gradients: AdamW moves a parameter by its decay alone
    for opt in (AdamW(np.ones(stage.num_params, np.float32), 0.1, weight_decay=0.5),
                ShardedOptimizer(j.train, np.ones(stage.num_params, np.float32),
                                 [(0, stage.num_params)], master=False)):  # fmt: skip
        opt.decayed = ranges
        opt.begin_step()
        opt.update(np.zeros(stage.num_params, np.float32), 0, stage.num_params)
        decayed = np.zeros(stage.num_params, bool)
        for lo, hi in ranges:
            decayed[lo:hi] = True
        np.testing.assert_allclose(opt.params[decayed], 0.95, rtol=1e-6)
        assert (opt.params[~decayed] == 1.0).all() and decayed.any() and (~decayed).any()
    assert list(decay_pieces(0, 10, [(2, 4), (6, 12)])) == [
        (0, 2, False), (2, 4, True), (4, 6, False), (6, 10, True)]  # fmt: skip
    assert list(decay_pieces(3, 5, None)) == [(3, 5, True)]
