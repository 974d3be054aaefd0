"""nn/gemm.py: the weight gradient's GEMM accumulated in place against numpy's g += x.T @ dy, on
the shapes and layouts the layers pass (row slices, a tied head's transposed gradient), and the
numpy expression wherever the in-place call cannot run."""

from __future__ import annotations

import numpy as np
import pytest

from mpihybrid._blas import openblas_path
from mpihybrid.nn import gemm


def _operands(rows, n_in, n_out, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n_in)).astype(dtype)
    dy = rng.standard_normal((rows, n_out)).astype(dtype)
    g = rng.standard_normal((n_in, n_out)).astype(dtype)
    return g, x, dy


needs_sgemm = pytest.mark.skipif(not openblas_path(), reason="numpy bundles no OpenBLAS here")


@needs_sgemm
def test_numpys_openblas_sgemm_is_found():
    assert gemm.available()


@pytest.fixture
def sgemm_calls(monkeypatch):
    """Counts the in-place sgemm's calls (so a test knows which path ran)."""
    calls, real = [], gemm._sgemm()

    def counted(*args):
        calls.append(args[3:6])
        real(*args)

    monkeypatch.setattr(gemm, "_sgemm", lambda: counted if real else None)
    return calls


@needs_sgemm
@pytest.mark.parametrize("shape", [(128, 240, 960), (128, 960, 240), (7, 5, 3), (1, 1, 1)])
def test_accumulates_what_numpy_adds(shape, sgemm_calls):
    rows, n_in, n_out = shape
    g, x, dy = _operands(rows, n_in, n_out)
    want = g + x.T @ dy
    gemm.accumulate_xt_dy(g, x, dy)
    assert sgemm_calls == [(n_in, n_out, rows)]
    np.testing.assert_allclose(g, want, rtol=2e-6, atol=2e-5)
    print("max |diff|", np.abs(g - want).max())


@needs_sgemm
def test_a_transposed_gradient_and_strided_rows(sgemm_calls):
    # a tied head's gradient is the embedding's (vocab, hidden) seen as (hidden, vocab); x a view
    rng = np.random.default_rng(1)
    table = rng.standard_normal((50, 16)).astype(np.float32)
    wide = rng.standard_normal((32, 24)).astype(np.float32)
    x, dy = wide[:, 4:20], rng.standard_normal((32, 50)).astype(np.float32)
    want = table.T + x.T @ dy
    gemm.accumulate_xt_dy(table.T, x, dy)
    np.testing.assert_allclose(table.T, want, rtol=2e-6, atol=2e-5)
    assert sgemm_calls == [(50, 16, 32)]  # g^T += dy^T x


def test_what_the_call_cannot_take_runs_the_numpy_expression(sgemm_calls):
    g, x, dy = _operands(9, 6, 4, dtype=np.float64)
    want = g + x.T @ dy
    gemm.accumulate_xt_dy(g, x, dy)  # float64: numpy's own
    np.testing.assert_array_equal(g, want)
    g, x, dy = _operands(9, 6, 4)
    x = np.asfortranarray(x)  # columns contiguous: not a row layout sgemm is given here
    want = g + x.T @ dy
    gemm.accumulate_xt_dy(g, x, dy)
    np.testing.assert_allclose(g, want, rtol=2e-6, atol=2e-6)
    g, x, dy = _operands(0, 6, 4)  # no rows: nothing to add
    before = g.copy()
    gemm.accumulate_xt_dy(g, x, dy)
    np.testing.assert_array_equal(g, before)
    assert sgemm_calls == []
