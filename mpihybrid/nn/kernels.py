"""Fused numba kernels for the elementwise work of a training step; numpy stays the reference.

Each kernel does in one pass over memory what its numpy reference (in layers.py,
transformer.py, optim.py) does in several, and layers take it when `fast(x)` holds: numba is
enabled (`mpihybrid._numba`), the array is a float32 numpy array (a GPU array or a float64
gradient check runs the reference). The tests compare each kernel with its reference
(tests/test_kernels.py), at these tolerances (float32):

    adamw_update        bit for bit (the same float32 operations in the same order)
    gelu_*              abs 1e-6 forward, 1e-5 backward (x, dy ~ N(0, 3^2)): tanh is a
                        rational approximation (max abs error 3.4e-7)
    layernorm_*         abs 1e-5 (row sums in another order than numpy's pairwise sums)
    softmax_causal_*    abs 1e-6 (a polynomial exp; numpy sums a row's terms in another order)
    bias_gelu_forward   as gelu_forward (the bias add is the same float32 addition)
    bias_residual_add   bit for bit
    embedding_backward  bit for bit (np.add.at's order, which the reference and a device use)
    rmsnorm_*           abs 1e-5 (row sums in another order than numpy's)
    swiglu_*            abs 1e-6 forward, 1e-5 backward (x, dy ~ N(0, 1); the sigmoid
                        through tanh_f32)
    rotary_pack         bit for bit (the same two products and sum, the same copies)
    rotary_unpack       abs 1e-6 (bit for bit in the tests: numpy adds the repeats in order)

No kernel for the cross-entropy: numpy's exp is vectorised, and a fused pass with a polynomial
exp measured 0.7-0.8x the reference (benchmarks/kernel_ab.py, issue #31); the loss is numpy's.

Every kernel is compiled with error_model="numpy": a division then cannot raise
ZeroDivisionError, which is what lets LLVM vectorise the loops (GELU: 0.22 ms against 2.0 ms
for the same loop with Python's error model, (128, 2048) elements, one core).

Shapes: N = elements, R = rows, C = features, A = attention rows of (b * h), T = tokens.
"""

from __future__ import annotations

import math

import numpy as np

from mpihybrid import _numba

njit = _numba.njit(error_model="numpy")
# reductions (row sums) vectorise only if their additions may be reordered, as numpy's pairwise
# sums reorder them too; no other fast-math liberty (no NaN or infinity assumptions)
njit_sums = _numba.njit(error_model="numpy", fastmath={"reassoc", "nsz", "arcp"})
f32 = np.float32


def fast(*arrays) -> bool:
    """Whether the kernels apply: numba on, every array a C-contiguous float32 numpy array."""
    return _numba.ENABLED and all(
        type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays
    )


# ---- AdamW: one pass over (p, g, m, v) instead of a dozen -------------------------------


@njit
def adamw_update(p, g, m, v, decay, b1, b2, scale, shift, apply_decay, g_scale):  # N each
    """m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; p = p decay - m / (sqrt(v) scale + shift),
    written as optim.AdamW's numpy passes write it, so the bits are the same; g is the gradient
    times g_scale (float32: train.grad_clip's coefficient, 1 otherwise), read once."""
    for i in range(p.size):
        gi = g[i] * g_scale
        pi = p[i] * decay if apply_decay else p[i]
        mi = (m[i] - gi) * b1 + gi
        g2 = gi * gi
        vi = (v[i] - g2) * b2 + g2
        m[i] = mi
        v[i] = vi
        p[i] = pi - mi / (np.sqrt(vi) * scale + shift)


# ---- GELU (tanh form): y = 0.5 x (1 + tanh(k (x + a x^3))) ---------------------------------

_GELU_K = f32(math.sqrt(2.0 / math.pi))
_GELU_KA = f32(math.sqrt(2.0 / math.pi) * 0.044715)
_GELU_3KA = f32(3.0 * math.sqrt(2.0 / math.pi) * 0.044715)
_HALF, _ONE = f32(0.5), f32(1.0)

# tanh as a rational function of odd degree 13 / even degree 6 on [-7.9, 7.9] (Eigen's float
# tanh): plain arithmetic vectorises, where numba's tanh calls libm one element at a time
# (7.4 ms against numpy's 1.3 ms for a GELU over (128, 2048)).
_TANH_CLAMP = f32(7.90531110763549805)
_TA = [
    f32(c)
    for c in (
        4.89352455891786e-03,
        6.37261928875436e-04,
        1.48572235717979e-05,
        5.12229709037114e-08,
        -8.60467152213735e-11,
        2.00018790482477e-13,
        -2.76076847742355e-16,
    )
]
_TB = [
    f32(c)
    for c in (
        4.89352518554385e-03,
        2.26843463243900e-03,
        1.18534705686654e-04,
        1.19825839466702e-06,
    )
]
_A1, _A3, _A5, _A7, _A9, _A11, _A13 = _TA
_B0, _B2, _B4, _B6 = _TB


@_numba.njit(error_model="numpy", inline="always")
def tanh_f32(x):
    """tanh(x) to 3.4e-7 absolute (tests/test_kernels.py), branch-free once compiled."""
    if x > _TANH_CLAMP:
        x = _TANH_CLAMP
    if x < -_TANH_CLAMP:
        x = -_TANH_CLAMP
    x2 = x * x
    p = x2 * _A13 + _A11
    p = x2 * p + _A9
    p = x2 * p + _A7
    p = x2 * p + _A5
    p = x2 * p + _A3
    p = x2 * p + _A1
    q = x2 * _B6 + _B4
    q = x2 * q + _B2
    q = x2 * q + _B0
    return x * p / q


@njit
def gelu_forward(x, y, t):  # N each
    """y = GELU(x); t = tanh(k (x + a x^3)), what the backward needs."""
    for i in range(x.size):
        xi = x[i]
        ti = tanh_f32((xi * xi * _GELU_KA + _GELU_K) * xi)
        t[i] = ti
        y[i] = (ti + _ONE) * xi * _HALF


@njit
def bias_gelu_forward(x, bias, y, t):  # (R, C), (C), (R, C), (R, C)
    """x += bias (in place: the GELU's input, kept for the backward); y = GELU(x); t as above.
    The Linear before the GELU leaves its bias to this pass (one pass instead of two)."""
    for r in range(x.shape[0]):
        for j in range(x.shape[1]):
            xi = x[r, j] + bias[j]
            x[r, j] = xi
            ti = tanh_f32((xi * xi * _GELU_KA + _GELU_K) * xi)
            t[r, j] = ti
            y[r, j] = (ti + _ONE) * xi * _HALF


@njit
def gelu_backward(dy, x, t, dx):  # N each
    """dx = dy * 0.5 (1 + t + x (1 - t^2) k (1 + 3 a x^2))."""
    for i in range(x.size):
        xi, ti = x[i], t[i]
        d = (xi * xi * _GELU_3KA + _GELU_K) * xi * (_ONE - ti * ti) + ti + _ONE
        dx[i] = d * _HALF * dy[i]


# ---- LayerNorm over the last dimension: y = (x - mean) rstd * w + b -------------------------


@njit_sums
def layernorm_forward(x, w, b, eps, y, xhat, rstd):  # (R, C), (C), (C), -, (R, C), (R, C), (R)
    c = x.shape[1]
    for r in range(x.shape[0]):
        total = np.float32(0.0)
        for j in range(c):
            total += x[r, j]
        m32 = total / np.float32(c)
        sq = np.float32(0.0)
        for j in range(c):
            d = x[r, j] - m32
            sq += d * d
        s = np.float32(1.0 / math.sqrt(sq / c + eps))
        rstd[r] = s
        for j in range(c):
            h = (x[r, j] - m32) * s
            xhat[r, j] = h
            y[r, j] = h * w[j] + b[j]


@njit_sums
def layernorm_backward_input(dy, xhat, rstd, w, dx):  # (R, C), (R, C), (R), (C), (R, C)
    """dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = dy w."""
    c = dy.shape[1]
    for r in range(dy.shape[0]):
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        for j in range(c):
            g = dy[r, j] * w[j]
            s1 += g
            s2 += g * xhat[r, j]
        m1 = s1 / np.float32(c)
        m2 = s2 / np.float32(c)
        s = rstd[r]
        for j in range(c):
            dx[r, j] = (dy[r, j] * w[j] - m1 - xhat[r, j] * m2) * s


@njit
def layernorm_backward_weight(dy, xhat, dw, db):  # (R, C), (R, C), (C), (C)
    """dw += sum over rows of dy xhat; db += sum over rows of dy (accumulated, as a W pass)."""
    for r in range(dy.shape[0]):
        for j in range(dy.shape[1]):
            g = dy[r, j]
            dw[j] += g * xhat[r, j]
            db[j] += g


# exp(u) for u <= 0 as 2^n exp(z), |z| <= ln2 / 2, exp(z) a degree-7 polynomial (Cephes' expf):
# plain arithmetic that vectorises, where numba's exp calls libm per element. exp_neg returns
# exp(z) and n << 23, which the caller adds into the float's exponent bits (2^n). Arguments
# below -87 give about 1e-38 instead of 0.
_LOG2E, _LN2_HI, _LN2_LO = f32(1.44269504088896341), f32(0.693359375), f32(-2.12194440e-4)
_EXP_LO = f32(-87.0)
_E0, _E1, _E2, _E3, _E4, _E5 = (
    f32(c)
    for c in (
        1.9875691500e-4,
        1.3981999507e-3,
        8.3334519073e-3,
        4.1665795894e-2,
        1.6666665459e-1,
        5.0000001201e-1,
    )
)


@_numba.njit(error_model="numpy", inline="always")
def exp_neg(u):
    """(exp(z), n << 23) with exp(u) = exp(z) 2^n, for u <= 0 (rel. error 2e-7 once combined)."""
    u = max(u, _EXP_LO)
    n = np.floor(u * _LOG2E + _HALF)
    z = u - n * _LN2_HI - n * _LN2_LO
    p = ((((_E0 * z + _E1) * z + _E2) * z + _E3) * z + _E4) * z + _E5
    return p * z * z + z + _ONE, np.int32(n) << 23


# ---- causal softmax over attention scores, in place -------------------------------------------


@njit_sums
def softmax_causal_forward(s, scale, exponent):  # (A, T, T) scores -> probabilities, in place
    """Row i of each (T, T) square: softmax of scale * s[i, :i+1]; zero beyond the diagonal
    (what the -inf mask gives), without touching the masked entries' exponentials. The
    exponentials are exp_neg's polynomial (vectorised: numba's exp calls libm per element);
    exponent (T) int32 scratch."""
    bits = s.view(np.int32)
    for a in range(s.shape[0]):
        for i in range(s.shape[1]):
            row = s[a, i]
            top = -np.inf
            for j in range(i + 1):
                v = row[j] * scale
                row[j] = v
                top = max(top, v)
            for j in range(i + 1):
                row[j], exponent[j] = exp_neg(row[j] - top)
            total = np.float32(0.0)
            for j in range(i + 1):
                bits[a, i, j] += exponent[j]
                total += row[j]
            inv = np.float32(1.0) / total
            for j in range(i + 1):
                row[j] *= inv
            for j in range(i + 1, s.shape[2]):
                row[j] = 0.0


@njit_sums
def softmax_causal_backward(dp, p, scale):  # (A, T, T) dprobs -> dscores, in place
    """ds = scale * p (dp - sum_j dp_j p_j); zero beyond the diagonal, where p = 0."""
    for a in range(dp.shape[0]):
        for i in range(dp.shape[1]):
            total = np.float32(0.0)
            for j in range(i + 1):
                total += dp[a, i, j] * p[a, i, j]
            for j in range(i + 1):
                dp[a, i, j] = p[a, i, j] * (dp[a, i, j] - total) * scale
            for j in range(i + 1, dp.shape[2]):
                dp[a, i, j] = 0.0


# ---- bias + residual: the branch's last Linear ends y = x W + b + skip in one pass -----------


@njit
def bias_residual_add(y, bias, skip):  # (R, C), (C), (R, C)
    """y += bias + skip, elementwise as (y + bias) + skip: numpy's two passes' order and bits."""
    for r in range(y.shape[0]):
        for j in range(y.shape[1]):
            y[r, j] = (y[r, j] + bias[j]) + skip[r, j]


# ---- embedding: the token table's gradient, row by row --------------------------------------


@njit
def embedding_backward(tokens, dy, grad):  # (T), (T, C), (V, C)
    """grad[tokens[i]] += dy[i] in token order: np.add.at's order and bits, without its
    per-element dispatch (0.4 ms for 128 tokens x 240)."""
    for i in range(tokens.shape[0]):
        row = grad[tokens[i]]
        for j in range(dy.shape[1]):
            row[j] += dy[i, j]


# ---- RMSNorm over the last dimension: y = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps) ---------


@njit_sums
def rmsnorm_forward(x, w, eps, y, xhat, rstd):  # (R, C), (C), -, (R, C), (R, C), (R)
    c = x.shape[1]
    for r in range(x.shape[0]):
        sq = np.float32(0.0)
        for j in range(c):
            sq += x[r, j] * x[r, j]
        s = np.float32(1.0) / np.float32(math.sqrt(sq / np.float32(c) + eps))
        rstd[r] = s
        for j in range(c):
            h = x[r, j] * s
            xhat[r, j] = h
            y[r, j] = h * w[j]


@njit_sums
def rmsnorm_backward_input(dy, xhat, rstd, w, dx):  # (R, C), (R, C), (R), (C), (R, C)
    """dx = rstd (dxhat - xhat mean(dxhat xhat)), dxhat = dy w."""
    c = dy.shape[1]
    for r in range(dy.shape[0]):
        total = np.float32(0.0)
        for j in range(c):
            total += dy[r, j] * w[j] * xhat[r, j]
        m = total / np.float32(c)
        s = rstd[r]
        for j in range(c):
            dx[r, j] = (dy[r, j] * w[j] - xhat[r, j] * m) * s


@njit
def rmsnorm_backward_weight(dy, xhat, dw):  # (R, C), (R, C), (C)
    """dw += sum over rows of dy xhat (accumulated, as a W pass)."""
    for r in range(dy.shape[0]):
        for j in range(dy.shape[1]):
            dw[j] += dy[r, j] * xhat[r, j]


# ---- SwiGLU: y = silu(gate) up, gate and up the two halves of x's features ---------------------


@njit
def swiglu_forward(x, y, sig):  # (R, 2F), (R, F), (R, F)
    """sig = sigmoid(gate) = (1 + tanh(gate / 2)) / 2, what the backward needs; y = gate sig up."""
    f = y.shape[1]
    for r in range(x.shape[0]):
        for j in range(f):
            g = x[r, j]
            si = (tanh_f32(g * _HALF) + _ONE) * _HALF
            sig[r, j] = si
            y[r, j] = g * si * x[r, f + j]


@njit
def swiglu_backward(dy, x, sig, dx):  # (R, F), (R, 2F), (R, F), (R, 2F)
    """dgate = dy up s (1 + gate (1 - s)), dup = dy gate s."""
    f = dy.shape[1]
    for r in range(dy.shape[0]):
        for j in range(f):
            g, si, d = x[r, j], sig[r, j], dy[r, j]
            dx[r, f + j] = g * si * d
            dx[r, j] = ((_ONE - si) * g + _ONE) * si * x[r, f + j] * d


# ---- the rotary embedding with grouped-query heads, into and out of the attention's layout ----


@njit
def rotary_pack(x, cos, sin, packed):  # (b, T, (h + 2g) d), (T, d), (T, d), (b, T, 3, g, r, d)
    """packed = (q, k, v) as the attention core takes them: each head's feature pair (i, i + d/2)
    of q and k turned by its angle (x cos + (x2, x1) sin; cos = [cos, cos], sin = [-sin, sin]),
    each of the g key/value heads repeated for its r query heads. The numpy path makes the same
    values in three passes and two copies."""
    g, r, d = packed.shape[3], packed.shape[4], packed.shape[5]
    half, q_width = d // 2, g * r * d
    for n in range(x.shape[0]):
        for t in range(x.shape[1]):
            for k in range(g):
                for j in range(r):
                    q = (k * r + j) * d
                    for i in range(half):
                        m = half + i  # i's pair
                        a, c = x[n, t, q + i], x[n, t, q + m]
                        packed[n, t, 0, k, j, i] = a * cos[t, i] + c * sin[t, i]
                        packed[n, t, 0, k, j, m] = c * cos[t, m] + a * sin[t, m]
                key, value = q_width + k * d, q_width + g * d + k * d
                for i in range(half):
                    m = half + i
                    a, c = x[n, t, key + i], x[n, t, key + m]
                    low = a * cos[t, i] + c * sin[t, i]
                    high = c * cos[t, m] + a * sin[t, m]
                    for j in range(r):
                        packed[n, t, 1, k, j, i] = low
                        packed[n, t, 1, k, j, m] = high
                for j in range(r):
                    for i in range(d):
                        packed[n, t, 2, k, j, i] = x[n, t, value + i]


@njit
def rotary_unpack(dpacked, cos, minus_sin, dx):  # (b, T, 3, g, r, d), (T, d), (T, d), (b, T, W)
    """rotary_pack's backward: the r repeats of each key/value head's gradient summed, q's and
    k's turned back by their angle (minus_sin = [sin, -sin])."""
    g, r, d = dpacked.shape[3], dpacked.shape[4], dpacked.shape[5]
    half, q_width = d // 2, g * r * d
    for n in range(dpacked.shape[0]):
        for t in range(dpacked.shape[1]):
            for k in range(g):
                for j in range(r):
                    q = (k * r + j) * d
                    for i in range(half):
                        m = half + i
                        a, c = dpacked[n, t, 0, k, j, i], dpacked[n, t, 0, k, j, m]
                        dx[n, t, q + i] = a * cos[t, i] + c * minus_sin[t, i]
                        dx[n, t, q + m] = c * cos[t, m] + a * minus_sin[t, m]
                key, value = q_width + k * d, q_width + g * d + k * d
                for i in range(half):
                    m = half + i
                    a, c = dpacked[n, t, 1, k, 0, i], dpacked[n, t, 1, k, 0, m]
                    for j in range(1, r):
                        a += dpacked[n, t, 1, k, j, i]
                        c += dpacked[n, t, 1, k, j, m]
                    dx[n, t, key + i] = a * cos[t, i] + c * minus_sin[t, i]
                    dx[n, t, key + m] = c * cos[t, m] + a * minus_sin[t, m]
                for i in range(d):
                    v = dpacked[n, t, 2, k, 0, i]
                    for j in range(1, r):
                        v += dpacked[n, t, 2, k, j, i]
                    dx[n, t, value + i] = v
