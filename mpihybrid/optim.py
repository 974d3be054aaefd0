"""Optimizers over one flat fp32 parameter buffer per stage: in place, no per-layer loop."""

from __future__ import annotations

import numpy as np


class SGD:
    """SGD with momentum (PyTorch convention: buf = mu*buf + g; p -= lr*buf) and L2 weight decay."""

    def __init__(
        self, params: np.ndarray, lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ):
        self.params, self.lr, self.momentum, self.weight_decay = params, lr, momentum, weight_decay
        self.buf = np.zeros_like(params) if momentum else None
        self.step_count = 0

    def step(self, grads: np.ndarray) -> None:
        if self.weight_decay:
            grads = grads + self.weight_decay * self.params
        if self.buf is not None:
            self.buf *= self.momentum
            self.buf += grads
            grads = self.buf
        self.params -= np.float32(self.lr) * grads
        self.step_count += 1

    def state(self) -> dict[str, np.ndarray]:
        return {} if self.buf is None else {"momentum": self.buf}


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter), bias-corrected."""

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
        self.tmp = np.empty_like(params)
        self.step_count = 0

    def step(self, grads: np.ndarray) -> None:
        self.step_count += 1
        b1, b2, t = self.beta1, self.beta2, self.step_count
        if self.weight_decay:
            self.params *= np.float32(1.0 - self.lr * self.weight_decay)
        self.m *= np.float32(b1)
        self.m += np.float32(1 - b1) * grads
        self.v *= np.float32(b2)
        np.multiply(grads, grads, out=self.tmp)
        self.tmp *= np.float32(1 - b2)
        self.v += self.tmp
        # p -= lr * m_hat / (sqrt(v_hat) + eps), with the bias corrections folded into scalars
        np.sqrt(self.v, out=self.tmp)
        self.tmp *= np.float32(1.0 / np.sqrt(1 - b2**t))
        self.tmp += np.float32(self.eps)
        np.divide(self.m, self.tmp, out=self.tmp)
        self.params -= np.float32(self.lr / (1 - b1**t)) * self.tmp

    def state(self) -> dict[str, np.ndarray]:
        return {"m": self.m, "v": self.v}


def build_optimizer(cfg, params: np.ndarray):
    if cfg.optimizer == "sgd":
        return SGD(params, cfg.lr, cfg.momentum, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return AdamW(params, cfg.lr, tuple(cfg.betas), weight_decay=cfg.weight_decay)
    raise ValueError(f"train.optimizer = {cfg.optimizer!r}: unknown")
