"""nanoGPT's files and recipe (issue 53): a bias = False checkpoint starts a run through
model.init (every bias zero, said once)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors is not installed (the weights extra)")
from safetensors.numpy import save_file  # noqa: E402

from mpihybrid.nn import weights as nw  # noqa: E402
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
