"""Optimizers over one flat fp32 parameter buffer per stage: in place, no per-layer loop.

Every optimizer steps in two parts, so that a stage can update each bucket of its gradient as
soon as that bucket's all-reduce is done:

    opt.begin_step()              # once per step: the step count and the per-step scalars
    opt.update(grads, lo, hi)     # parameters [lo, hi) from grads[lo:hi]; any slices that
    ...                           # cover the buffer once, in any order
    opt.step(grads)               # = begin_step(); update(grads, 0, n)

The update is elementwise, so any such cover gives the same bits as one whole-buffer update
(a test holds it). The buffers may live on a GPU (CuPy): state is made like the parameters,
and `np.` ufuncs dispatch to the parameters' array module. With numba (`_numba.ENABLED`) and
numpy buffers, AdamW is one fused pass (`kernels.adamw_update`): the same float32 operations
in the same order, hence the same bits as the numpy reference (tests/test_kernels.py).
"""

from __future__ import annotations

import numpy as np

from mpihybrid import _numba
from mpihybrid.comm.device import array_module
from mpihybrid.nn import kernels


class SGD:
    """SGD with momentum (PyTorch convention: buf = mu*buf + g; p -= lr*buf) and L2 weight decay."""

    def __init__(
        self, params: np.ndarray, lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ):
        self.params, self.lr, self.momentum, self.weight_decay = params, lr, momentum, weight_decay
        self.buf = np.zeros_like(params) if momentum else None
        self.step_count = 0

    def begin_step(self) -> None:
        self.step_count += 1

    def update(self, grads: np.ndarray, lo: int, hi: int) -> None:
        p, g = self.params[lo:hi], grads[lo:hi]
        if self.weight_decay:
            g = g + self.weight_decay * p
        if self.buf is not None:
            buf = self.buf[lo:hi]
            buf *= self.momentum
            buf += g
            g = buf
        p -= np.float32(self.lr) * g

    def step(self, grads: np.ndarray) -> None:
        self.begin_step()
        self.update(grads, 0, self.params.size)

    def state(self) -> dict[str, np.ndarray]:
        return {} if self.buf is None else {"momentum": self.buf}


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter), bias-corrected.

    The numpy reference walks the buffers in blocks of BLOCK elements: the dozen in-place
    passes of one block stay in the CPU cache instead of streaming every buffer from memory a
    dozen times (about 3x faster on a 6M-parameter stage; 64K elements measured best, 18.6 ms
    against 21.8 ms for 16K). On a GPU each pass is one kernel over the whole buffer.
    """

    BLOCK = 1 << 16

    def __init__(
        self,
        params: np.ndarray,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        self.params, self.lr, self.eps, self.weight_decay = params, lr, eps, weight_decay
        self.beta1, self.beta2 = betas
        self.m = np.zeros_like(params)
        self.v = np.zeros_like(params)
        xp = array_module(params)
        self.fused = _numba.ENABLED and xp is np and params.dtype == np.float32
        self.block = self.BLOCK if xp is np else max(params.size, 1)
        self.tmp = xp.empty(0 if self.fused else min(self.block, params.size), params.dtype)
        self.step_count = 0
        self._scalars: tuple = ()

    def begin_step(self) -> None:
        self.step_count += 1
        t = self.step_count
        f = self.params.dtype.type
        # p -= lr * m_hat / (sqrt(v_hat) + eps) = m / (sqrt(v) * scale + shift): the step size
        # and both bias corrections folded into two scalars of the denominator
        step = self.lr / (1 - self.beta1**t)
        scale = f(1.0 / (np.sqrt(1 - self.beta2**t) * step))
        shift = f(self.eps / step)
        decay = f(1.0 - self.lr * self.weight_decay)
        self._scalars = (decay, f(self.beta1), f(self.beta2), scale, shift)

    def update(self, grads: np.ndarray, lo: int, hi: int) -> None:
        decay, b1, b2, scale, shift = self._scalars
        if self.fused:
            kernels.adamw_update(
                self.params[lo:hi], grads[lo:hi], self.m[lo:hi], self.v[lo:hi],
                decay, b1, b2, scale, shift, bool(self.weight_decay),
            )  # fmt: skip
            return
        for start in range(lo, hi, self.block):
            end = min(start + self.block, hi)
            sl = slice(start, end)
            p, g, m, v = self.params[sl], grads[sl], self.m[sl], self.v[sl]
            tmp = self.tmp[: end - start]
            if self.weight_decay:
                p *= decay
            m -= g  # m = b1 m + (1 - b1) g, as g + b1 (m - g): no temporary
            m *= b1
            m += g
            np.multiply(g, g, out=tmp)  # v = b2 v + (1 - b2) g^2, likewise
            v -= tmp
            v *= b2
            v += tmp
            np.sqrt(v, out=tmp)
            tmp *= scale
            tmp += shift
            np.divide(m, tmp, out=tmp)
            p -= tmp

    def step(self, grads: np.ndarray) -> None:
        self.begin_step()
        self.update(grads, 0, self.params.size)

    def state(self) -> dict[str, np.ndarray]:
        return {"m": self.m, "v": self.v}


def build_optimizer(cfg, params: np.ndarray):
    if cfg.optimizer == "sgd":
        return SGD(params, cfg.lr, cfg.momentum, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return AdamW(params, cfg.lr, tuple(cfg.betas), weight_decay=cfg.weight_decay)
    raise ValueError(f"train.optimizer = {cfg.optimizer!r}: unknown")
