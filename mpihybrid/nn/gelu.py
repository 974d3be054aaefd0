"""GELU in its exact form (model.gelu = "erf", nanoGPT's and torch's default), beside
layers.GELU's tanh form (GPT-2's, the default): `transformer.gpt_blocks` picks one.

    y, cache = GELUErf().forward(x); dx, _ = GELUErf().backward_input(dy, cache)
"""

from __future__ import annotations

import math

import numpy as np

from mpihybrid.nn.layers import GELU, Cost, Layer

# erf to 1.5e-7 (Abramowitz & Stegun 7.1.26): numpy has no erf, and float32 holds no more
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf(x: np.ndarray) -> np.ndarray:
    """erf elementwise, |error| < 1.5e-7 (in x's dtype)."""
    f = x.dtype.type
    a = np.abs(x)
    t = f(1.0) / (f(1.0) + f(_ERF_P) * a)
    poly = np.zeros_like(x)
    for coef in reversed(_ERF_A):  # Horner: (((a5 t + a4) t + a3) t + a2) t + a1, then * t
        poly += f(coef)
        poly *= t
    y = f(1.0) - poly * np.exp(-(a * a))
    return np.copysign(y, x)


class GELUErf(Layer):
    """GELU in its exact form, x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)): nanoGPT's and torch's
    default (model.gelu = "erf"); numpy passes, no fused kernel. Caches x and Phi(x)."""

    def __repr__(self) -> str:
        return "GELU(erf)"

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        f = x.dtype.type
        phi = erf(x * f(1.0 / math.sqrt(2.0)))
        phi += f(1.0)
        phi *= f(0.5)
        return x * phi, (x, phi)

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        # dy/dx = Phi(x) + x phi(x), phi the standard normal density
        x, phi = cache
        f = dy.dtype.type
        d = np.multiply(x, x)
        d *= f(-0.5)
        np.exp(d, out=d)
        d *= f(1.0 / math.sqrt(2.0 * math.pi))
        d *= x
        d += phi
        d *= dy
        return d, None

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        return GELU.cost(self, rows, width, need_dx)
