"""Stage.backward_weight_merged against k serial backward_weight calls: MLP, GPT and llama stages.

python -m pytest -q tests/test_merged_w.py

Each case runs k micro-batches' forward and input gradient once, then the weight gradients
twice from zeroed buffers: serially, and merged. The Linear weights' sum runs in another order,
so they agree within float32 rounding: each tensor within TOL of its largest |value| (the worst
seen on gpt_bench's stages is 8.6e-7, Linear.backward_weight_merged; these shapes are smaller).
A dropped micro-batch moves a tensor by about 1/k of itself, far past TOL.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mpihybrid.nn import gemm
from mpihybrid.nn.kinds import model_kind
from mpihybrid.nn.layers import Linear
from mpihybrid.nn.model import build_stage
from mpihybrid.nn.profile import stage_wcaches
from mpihybrid.nn.transformer import Residual
from mpihybrid.train.tie import bind_local

TOL = 4e-6  # of each tensor's largest |value|: float32 rounding, ~4x the worst seen
# b = sequences (or samples) per micro-batch, T = tokens, C = width, V = vocabulary / classes
b, T, C, V = 3, 8, 16, 23
C_IN = 12  # the MLP's input features


def mlp(depth=4):
    return SimpleNamespace(kind="mlp", hidden=C, depth=depth, activation="gelu", norm=True,
                           partition="cost")  # fmt: skip


def gpt(depth=2, tie=False):
    return SimpleNamespace(kind="gpt", hidden=C, depth=depth, heads=4, ffn=40, partition="cost",
                           tie_embeddings=tie, vocab_parallel=False, gelu="tanh")  # fmt: skip


def llama(depth=2, tie=False):
    return SimpleNamespace(kind="llama", hidden=C, depth=depth, heads=4, kv_heads=2, ffn=24,
                           partition="cost", tie_embeddings=tie)  # fmt: skip


# (name, config, chunk, chunks): whole models end in the head and the loss; the others do not
CASES = {
    "mlp whole": (mlp(), 0, 1),
    "mlp last of 2": (mlp(), 1, 2),
    "gpt whole": (gpt(), 0, 1),
    "gpt tied whole": (gpt(tie=True), 0, 1),
    "gpt first of 2 (no head)": (gpt(depth=3), 0, 2),
    "gpt middle of 3 (no embedding, no head)": (gpt(depth=3), 1, 3),
    "llama whole": (llama(), 0, 1),
    "llama middle of 3": (llama(depth=3), 1, 3),
}


def inputs(cfg, chunk: int, k: int, seed: int = 0):
    """k micro-batches' (inputs, targets) of `chunk`: tokens or features into chunk 0, else
    activations (b, T, C)."""
    rng = np.random.default_rng(seed)
    tokens = cfg.kind != "mlp"
    if chunk > 0:
        shape = (b, T, C) if tokens else (b, C)
        xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(k)]
    elif tokens:
        xs = [rng.integers(0, V, size=(b, T)) for _ in range(k)]
    else:
        xs = [rng.standard_normal((b, C_IN)).astype(np.float32) for _ in range(k)]
    targets = [rng.integers(0, V, size=(b, T) if tokens else b) for _ in range(k)]
    return xs, targets


def make_stage(cfg, chunk: int, chunks: int, dtype=np.float32):
    """A stage with its parameters moved off their init (a GPT's biases start at 0)."""
    features = T if cfg.kind != "mlp" else C_IN
    stage = build_stage(cfg, features, V, chunk, chunks, seed=1, dtype=dtype)
    stage.flat_params += 0.05 * np.random.default_rng(2).standard_normal(stage.num_params)
    bind_local([stage], cfg)  # a tied model: the head's weight is the table's, transposed
    return stage


def wcaches_of(cfg, chunk, chunks, k, dtype=np.float32):
    stage = make_stage(cfg, chunk, chunks, dtype)
    xs, targets = inputs(cfg, chunk, k)
    xs = [x.astype(dtype) if x.dtype.kind == "f" else x for x in xs]
    loss = model_kind(cfg.kind).loss() if chunk == chunks - 1 else None
    return stage, stage_wcaches(stage, xs, targets, loss, chunk == 0)


def serial_and_merged(stage, wcaches):
    """(flat grads, on_grad offsets) of k backward_weight calls, then of one merged pass."""
    out = []
    for merged in (False, True):
        stage.zero_grad()
        offsets: list[int] = []
        if merged:
            stage.backward_weight_merged(wcaches, offsets.append)
        else:
            for wc in wcaches:
                stage.backward_weight(wc, offsets.append)
        out.append((stage.flat_grads.copy(), offsets))
    return out


def assert_tensors_close(stage, merged, serial, tol=TOL):
    """Each parameter tensor within tol of its largest |value| (one atol for all would let a
    small tensor's error hide under the largest one's)."""
    bounds = [*stage.tensor_offsets, stage.num_params]
    worst = 0.0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        scale = float(np.abs(serial[lo:hi]).max())
        assert scale > 0, f"tensor at {lo} has no gradient: the case tests nothing there"
        np.testing.assert_allclose(merged[lo:hi], serial[lo:hi], rtol=0, atol=tol * scale,
                                   err_msg=f"tensor at flat offset {lo}")  # fmt: skip
        worst = max(worst, float(np.abs(merged[lo:hi] - serial[lo:hi]).max()) / scale)
    print(f"worst |merged - serial| / max |tensor| = {worst:.2e}")


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_merged_matches_serial_and_calls_on_grad_alike(case, k):
    stage, wcaches = wcaches_of(*CASES[case], k)
    (serial, serial_at), (merged, merged_at) = serial_and_merged(stage, wcaches)
    if k == 1:
        np.testing.assert_array_equal(merged, serial)  # the loop: serial's bits
    assert_tensors_close(stage, merged, serial)
    # on_grad: once per layer, from the last, as backward_weight calls it per micro-batch
    per_call = len(stage.layers)
    assert merged_at == serial_at[-per_call:] == serial_at[:per_call]
    assert merged_at == [lo for lo, _ in reversed(stage.param_ranges)]


@pytest.mark.parametrize("case", ["gpt whole", "llama middle of 3", "mlp whole"])
def test_numpy_reference_gemm_path_matches_too(case, monkeypatch):
    monkeypatch.setattr(gemm, "ENABLED", False)  # numpy's g += x.T @ dy instead of the sgemm
    stage, wcaches = wcaches_of(*CASES[case], 3)
    (serial, _), (merged, _) = serial_and_merged(stage, wcaches)
    assert_tensors_close(stage, merged, serial)


@pytest.mark.parametrize("case", ["gpt whole", "llama whole", "mlp whole"])
def test_float64_stage_falls_back_to_serial_bits(case, monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "gather", lambda *a: calls.append(a) or pytest.fail("gathered"))
    stage, wcaches = wcaches_of(*CASES[case], 3, dtype=np.float64)
    assert stage.flat_grads.dtype == np.float64
    (serial, _), (merged, _) = serial_and_merged(stage, wcaches)
    np.testing.assert_array_equal(merged, serial)
    assert not calls


def test_merged_path_gathers_every_linear_once_into_one_scratch(monkeypatch):
    """float32 and k > 1: each Linear gathers (one GEMM), and the scratch ends as one gather of
    the widest Linear, k b T (in + out) floats, not one buffer per layer."""
    monkeypatch.setattr(gemm, "_scratch", np.empty(0, np.float32))
    gathers = []
    real = gemm.gather
    monkeypatch.setattr(gemm, "gather", lambda xs, dys: gathers.append(len(xs)) or real(xs, dys))
    k = 3
    stage, wcaches = wcaches_of(*CASES["gpt whole"], k)
    stage.zero_grad()
    stage.backward_weight_merged(wcaches)
    linears = [
        sub
        for layer in stage.layers
        for sub in (layer.branch if isinstance(layer, Residual) else [layer])
        if isinstance(sub, Linear)
    ]
    assert gathers == [k] * len(linears)
    widest = max(lin.cost(b * T, lin.in_features).merge_row_bytes for lin in linears)
    assert widest == 4 * (C + 3 * C)  # the attention's q/k/v projection, here
    assert gemm.scratch_bytes() == k * b * T * widest


def test_a_dropped_or_repeated_microbatch_is_caught():
    stage, wcaches = wcaches_of(*CASES["gpt middle of 3 (no embedding, no head)"], 3)
    stage.zero_grad()
    for wc in wcaches:
        stage.backward_weight(wc)
    serial = stage.flat_grads.copy()
    for wrong in (wcaches[:2], [wcaches[0], wcaches[1], wcaches[1]]):
        stage.zero_grad()
        stage.backward_weight_merged(wrong)
        with pytest.raises(AssertionError):
            assert_tensors_close(stage, stage.flat_grads.copy(), serial)


def test_recomputed_stage_merges_its_plain_wcaches():
    cfg, chunk, chunks = CASES["gpt first of 2 (no head)"]
    stage = make_stage(cfg, chunk, chunks)
    stage.recompute = True  # the forward keeps its input; backward_input redoes the forward
    xs, targets = inputs(cfg, chunk, 2)
    wcaches = stage_wcaches(stage, xs, targets, None, True)
    (serial, _), (merged, _) = serial_and_merged(stage, wcaches)
    assert_tensors_close(stage, merged, serial)


def test_no_microbatches_is_refused():
    stage, _ = wcaches_of(*CASES["mlp whole"], 1)
    with pytest.raises(ValueError, match="no micro-batches"):
        stage.backward_weight_merged([])
