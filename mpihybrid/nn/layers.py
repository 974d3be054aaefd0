"""numpy layers as forward/backward pairs (the softmax cross-entropy loss: nn/loss.py).

`forward(x)` returns `(y, cache)`; the cache holds exactly what the backward pass needs.
The backward pass comes in two halves so that zero-bubble schedules can run them at
different times: `backward_input` (dx, needed at once by the previous stage) and
`backward_weight` (weight gradients, which can wait). `backward` is both in a row.
Weight gradients are accumulated (`+=`) into the bound gradient views, so micro-batches
sum without extra buffers; whoever owns the buffers zeroes them once per step.

Parameters live elsewhere (one flat buffer per stage, see model.py): a layer only gets
views of them through `bind`. Everything is computed in the input's dtype, with the input's
array module: numpy, or CuPy for arrays on a GPU (`np.` ufuncs and functions dispatch to CuPy;
whatever creates an array asks `array_module(x)`). A float32 numpy array takes the fused
numba kernels of kernels.py where numba is enabled (`kernels.fast`); the numpy code here is
their reference, what a float64 gradient check and a GPU run execute.

Beside forward and backward, every layer declares what they cost: `cost(rows, width)` gives
the GEMM shapes of each pass (F, B, W), the bytes its elementwise work reads and writes, the
bytes its forward's cache keeps and the largest temporary a pass allocates. `mpihybrid predict`,
bench train's roofline and the memory check before a run read that declaration and nothing
else: a new layer declares its cost here, next to the code that incurs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from mpihybrid.comm.device import array_module
from mpihybrid.nn import gemm, kernels

# B = rows (all leading dimensions flattened), C = features, K = classes


FLOAT = 4  # bytes of a float32
PASSES = ("F", "B", "W")  # forward, input gradient, weight gradient
Gemm = tuple[int, int, int, int]  # (batch, m, k, n): `batch` products of (m, k) @ (k, n)


def matmul_flops(gemm: Gemm) -> int:
    """FLOPs of one Gemm: `batch` products of (m, k) @ (k, n), a multiply and an add each."""
    b, m, k, n = gemm
    return 2 * b * m * k * n


@dataclass
class Cost:
    """What a layer's passes cost on one micro-batch of `rows` rows (float32), as its code runs
    them: what predict, bench train's roofline and the memory check read.

    gemms[p]        every matmul of pass p ("F", "B", "W") as (batch, m, k, n)
    elem_bytes[p]   bytes the elementwise work of pass p reads and writes
    calls[p]        layer calls of pass p (a per-call overhead each; W only with parameters)
    kept_bytes      bytes of the arrays the forward's cache keeps alive until the backward (its
                    input among them when it keeps it; no layer keeps its output)
    temporary_bytes the largest array a pass allocates and drops
    merge_row_bytes bytes a merged W gathers per row (Linear: its x and dy rows); the gather
                    lands in nn/gemm's one scratch, so a merged W of R rows in all holds
                    R x the largest layer's figure, kept between steps
    """

    params: int = 0
    out_width: int = 0
    gemms: dict[str, list[Gemm]] = field(default_factory=lambda: {p: [] for p in PASSES})
    elem_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PASSES, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PASSES, 0))
    kept_bytes: int = 0
    temporary_bytes: int = 0
    merge_row_bytes: int = 0

    def flops(self, kind: str | None = None) -> int:
        """Matmul FLOPs of pass `kind`, or of all three."""
        kinds = PASSES if kind is None else (kind,)
        return sum(matmul_flops(g) for p in kinds for g in self.gemms[p])

    def add(self, other: Cost) -> None:
        """Fold a sub-layer's cost into this one (a Residual's branch)."""
        for p in PASSES:
            self.gemms[p] += other.gemms[p]
            self.elem_bytes[p] += other.elem_bytes[p]
            self.calls[p] += other.calls[p]
        self.kept_bytes += other.kept_bytes
        self.temporary_bytes = max(self.temporary_bytes, other.temporary_bytes)
        self.merge_row_bytes = max(self.merge_row_bytes, other.merge_row_bytes)


def layer_costs(layers: list, rows: int, width: int, need_dx: bool = True) -> list[Cost]:
    """The cost of each layer of a chain on `rows` rows of `width` input features, each
    layer's input the previous one's output; need_dx=False: the first layer skips its input
    gradient (the model's first layer)."""
    out = []
    for i, layer in enumerate(layers):
        cost = layer.cost(rows, width, need_dx or i > 0)
        out.append(cost)
        width = cost.out_width
    return out


class Layer:
    """A layer without parameters unless a subclass declares some in `param_shapes`."""

    params: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]

    def __init__(self) -> None:
        self.params = {}
        self.grads = {}

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def init_params(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """Fill `params` (arrays shaped as `param_shapes`) in place."""

    def bind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        """Use these arrays (views into a stage's flat buffers) as parameters and gradients."""
        self.params = params
        self.grads = grads

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        raise NotImplementedError

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        raise NotImplementedError

    def backward_weight(self, wcache: object) -> None:
        """Accumulate weight gradients; nothing to do without parameters."""

    def backward_weight_merged(self, wcaches: list[object]) -> None:
        """The weight gradients of several micro-batches (their wcaches) in one call: here each
        in turn, the bits of as many backward_weight calls; Linear gathers them into one GEMM."""
        for wc in wcaches:
            self.backward_weight(wc)

    def backward(self, dy: np.ndarray, cache: object, need_dx: bool = True) -> np.ndarray | None:
        dx, wcache = self.backward_input(dy, cache, need_dx)
        self.backward_weight(wcache)
        return dx

    def flops(self, batch: int) -> int:
        """Forward matmul FLOPs for `batch` rows, from the layer's cost declaration (a layer
        without matmuls: 0)."""
        return 0

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        """What forward and backward cost on `rows` rows of `width` features (see Cost); a
        layer without its own declaration costs nothing but its calls."""
        return self._base_cost(width)

    def _base_cost(self, out_width: int) -> Cost:
        params = sum(math.prod(s) for s in self.param_shapes().values())
        calls = {"F": 1, "B": 1, "W": 1 if params else 0}
        return Cost(params=params, out_width=out_width, calls=calls)


def _rows(a: np.ndarray) -> np.ndarray:
    """(..., C) -> (B, C) without copying."""
    return a.reshape(-1, a.shape[-1])


def norm_dx_kernel(kernel, dy: np.ndarray, cache: tuple, w: np.ndarray) -> np.ndarray | None:
    """A normalisation's input gradient by its numba kernel (LayerNorm's, RMSNorm's: dy, xhat,
    rstd, the weight, into dx), or None where the arrays are not the kernels' (the numpy
    reference runs instead)."""
    if not kernels.fast(dy, w):
        return None
    xhat, rstd = cache
    dx = np.empty_like(dy)
    kernel(_rows(dy), _rows(xhat), rstd.reshape(-1), w, _rows(dx))
    return dx


class Linear(Layer):
    """y = x @ W + b with W of shape (in, out); x may have leading dimensions, (..., in).

    init_std: None draws He-initialised weights (ReLU stacks); a number draws N(0, init_std^2).
    tied: W is not this layer's parameter (not in its stage's flat buffer): tie() hands it a
    view of another's, and of that one's gradient (a GPT's head tied to its token table).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_std: float | None = None,
        *,
        tied: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = bias
        self.init_std = init_std
        self.tied = tied
        # a GELU right after adds this bias in its own pass (GELU.bias_from): set by Residual
        self.bias_to_next = False

    def __repr__(self) -> str:
        tied = ", tied" if self.tied else ""
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias}{tied})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {} if self.tied else {"weight": (self.in_features, self.out_features)}
        if self.bias:
            shapes["bias"] = (self.out_features,)
        return shapes

    def bind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        super().bind(params, grads)
        if self.tied:  # a W of its own (zeros) until tie() hands it the shared one: a stage
            like = next(iter(params.values()), np.empty(0, np.float32))  # alone (profiles)
            shape = (self.in_features, self.out_features)
            xp = array_module(like)
            self.tie(xp.zeros(shape, like.dtype), xp.zeros(shape, like.dtype))

    def tie(self, weight: np.ndarray, grad: np.ndarray) -> None:
        """A tied layer's W (in, out) and its gradient: views of the arrays it shares (after
        every bind: the stage's buffers moved)."""
        self.params["weight"], self.grads["weight"] = weight, grad

    def init_params(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        # He init keeps the activation scale roughly constant through ReLU stacks
        std = math.sqrt(2.0 / self.in_features) if self.init_std is None else self.init_std
        if not self.tied:
            params["weight"][...] = rng.standard_normal(params["weight"].shape) * std
        if self.bias:
            params["bias"][...] = 0.0

    def forward(self, x: np.ndarray, skip: np.ndarray | None = None) -> tuple[np.ndarray, object]:
        """skip: a residual (..., out) added to the output (a branch's last layer)."""
        w = self.params["weight"].astype(x.dtype, copy=False)
        # one GEMM over all rows: (..., in) @ (in, out) would loop over the leading dimension
        y = _rows(x) @ w
        if self.bias and self.bias_to_next and kernels.fast(y):
            pass  # the GELU after adds the bias in its pass (the same test on the same array)
        elif self.bias and skip is not None and kernels.fast(y, skip):
            kernels.bias_residual_add(y, self.params["bias"], _rows(skip))
            skip = None
        elif self.bias:
            y += self.params["bias"].astype(x.dtype, copy=False)
        if skip is not None:
            y += _rows(skip)
        return y.reshape(*x.shape[:-1], self.out_features), x

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        x = cache
        # the model's first layer needs no input gradient: skip a matmul as big as its forward
        if not need_dx:
            return None, (x, dy)
        dx = _rows(dy) @ self.params["weight"].astype(dy.dtype, copy=False).T
        return dx.reshape(*dy.shape[:-1], self.in_features), (x, dy)

    def backward_weight(self, wcache: object) -> None:
        x, dy = wcache
        dy2 = _rows(dy)
        gemm.accumulate_xt_dy(self.grads["weight"], _rows(x), dy2)  # in place, no temporary
        if self.bias:
            self.grads["bias"] += dy2.sum(axis=0)

    def backward_weight_merged(self, wcaches: list[object]) -> None:
        """k micro-batches' weight gradient as ONE GEMM over their rows, gathered into nn/gemm's
        scratch: dW += [x1; ..; xk]^T [dy1; ..; dyk]; the bias as serial, dy by dy. At
        64 rows a micro-batch, 4 merged take 0.82 of the separate GEMMs' time, the gather
        counted (benchmarks/gemm_ab.py --merge 4 --rows 64). The weight's sum runs in another
        order than k backward_weight calls: within float32 rounding of theirs (worst |merged -
        serial| on gpt_bench's stages, k = 2..8 of 64 or 128 rows: 8.6e-7 of the tensor's
        largest |value|; against float64 7e-7, serial's 4e-7; tests/test_merged_w.py allows
        4e-6). One micro-batch, or arrays other than float32 numpy ones (float64, a GPU's): the
        loop, serial's bits."""
        xs = [_rows(x) for x, _ in wcaches]
        dys = [_rows(dy) for _, dy in wcaches]
        if len(wcaches) == 1 or not all(gemm.gatherable(a) for a in (*xs, *dys)):
            return super().backward_weight_merged(wcaches)
        gemm.accumulate_xt_dy(self.grads["weight"], *gemm.gather(xs, dys))
        # the bias dy by dy: serial's bits (one sum over all the rows adds them in a row: on
        # gpt_bench 10x the weight's error, 8.6e-6 of the largest |value|)
        for dy in dys if self.bias else ():
            self.grads["bias"] += dy.sum(axis=0)

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # F: x @ W, y += b;  B: dy @ W^T (not the model's first layer);  W: x^T @ dy added to
        # the gradient inside the GEMM (nn/gemm; else a temporary, read and written), the bias's
        # row sum.  Keeps x.
        i, o = self.in_features, self.out_features
        c = self._base_cost(o)
        c.gemms["F"].append((1, rows, i, o))
        if need_dx:
            c.gemms["B"].append((1, rows, o, i))
        c.gemms["W"].append((1, i, rows, o))
        c.elem_bytes["F"] = 8 * rows * o if self.bias else 0
        temporary = 0 if gemm.available() else i * o
        c.elem_bytes["W"] = 12 * temporary + (4 * rows * o if self.bias else 0)
        c.kept_bytes = FLOAT * rows * i
        c.temporary_bytes = FLOAT * max(temporary, rows * o, rows * i)
        c.merge_row_bytes = FLOAT * (i + o)
        return c

    def flops(self, batch: int) -> int:
        return self.cost(batch, self.in_features).flops("F")


class ReLU(Layer):
    def __repr__(self) -> str:
        return "ReLU()"

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        # a boolean mask is all backward needs, at 1 byte per element
        mask = x > 0
        return x * mask, mask

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        return dy * cache, None

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # F: the mask (read 4, write 1), x * mask (read 5, write 4);  B: dy * mask (9).  Keeps
        # the mask, one byte an element.
        n = rows * width
        c = self._base_cost(width)
        c.elem_bytes.update(F=14 * n, B=9 * n)
        c.kept_bytes = n
        c.temporary_bytes = FLOAT * n
        return c


_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


class GELU(Layer):
    """GELU, tanh approximation: 0.5 x (1 + tanh(k (x + a x^3))).

    Written as in-place passes over one or two buffers: `x**3` and chains of temporaries
    would cost more than the matmuls around a wide feed-forward layer.
    """

    def __init__(self) -> None:
        super().__init__()
        # the Linear before this GELU, when it leaves its bias to this pass (Residual sets it)
        self.bias_from: Linear | None = None

    def __repr__(self) -> str:
        return "GELU()"

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        if self.bias_from is not None and kernels.fast(x):  # its Linear left out the bias
            y, t = np.empty_like(x), np.empty_like(x)
            kernels.bias_gelu_forward(_rows(x), self.bias_from.params["bias"], _rows(y), _rows(t))
            return y, (x, t)
        if kernels.fast(x):
            y, t = np.empty_like(x), np.empty_like(x)
            kernels.gelu_forward(x.reshape(-1), y.reshape(-1), t.reshape(-1))
            return y, (x, t)
        f = x.dtype.type
        t = np.multiply(x, x)
        t *= f(_GELU_K * _GELU_A)
        t += f(_GELU_K)
        t *= x  # k (x + a x^3)
        np.tanh(t, out=t)
        y = t + f(1.0)
        y *= x
        y *= f(0.5)
        return y, (x, t)

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        # dy/dx = 0.5 (1 + t + x (1 - t^2) k (1 + 3 a x^2))
        x, t = cache
        if kernels.fast(dy, x):
            dx = np.empty_like(dy)
            kernels.gelu_backward(dy.reshape(-1), x.reshape(-1), t.reshape(-1), dx.reshape(-1))
            return dx, None
        f = dy.dtype.type
        d = np.multiply(x, x)
        d *= f(3.0 * _GELU_K * _GELU_A)
        d += f(_GELU_K)
        d *= x
        s = np.multiply(t, t)
        np.subtract(f(1.0), s, out=s)
        d *= s
        d += t
        d += f(1.0)
        d *= f(0.5)
        d *= dy
        return d, None

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # the fused kernels: F reads x, writes y and t (12);  B reads dy, x, t, writes dx (16).
        # Keeps x and t.
        n = rows * width
        c = self._base_cost(width)
        c.elem_bytes.update(F=12 * n, B=16 * n)
        c.kept_bytes = 2 * FLOAT * n
        c.temporary_bytes = FLOAT * n
        return c


class LayerNorm(Layer):
    """Normalise over the last dimension, then scale and shift: y = xhat * weight + bias."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps

    def __repr__(self) -> str:
        return f"LayerNorm({self.dim}, eps={self.eps})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.dim,), "bias": (self.dim,)}

    def init_params(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        params["weight"][...] = 1.0
        params["bias"][...] = 0.0

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, object]:
        if kernels.fast(x):
            y, xhat = np.empty_like(x), np.empty_like(x)
            rstd = np.empty((*x.shape[:-1], 1), x.dtype)
            w, b = self.params["weight"], self.params["bias"]
            kernels.layernorm_forward(
                _rows(x), w, b, self.eps, _rows(y), _rows(xhat), rstd.reshape(-1)
            )
            return y, (xhat, rstd)
        f = x.dtype.type
        xc = x - x.mean(axis=-1, keepdims=True)
        # row sums of squares as one contraction: no (..., C) temporary
        var = np.einsum("...c,...c->...", xc, xc)[..., None]
        var *= f(1.0 / self.dim)
        var += f(self.eps)
        rstd = np.sqrt(var, out=var)
        np.divide(f(1.0), rstd, out=rstd)
        xhat = np.multiply(xc, rstd, out=xc)
        y = xhat * self.params["weight"].astype(x.dtype, copy=False)
        y += self.params["bias"].astype(x.dtype, copy=False)
        return y, (xhat, rstd)

    def backward_input(
        self, dy: np.ndarray, cache: object, need_dx: bool = True
    ) -> tuple[np.ndarray | None, object]:
        xhat, rstd = cache
        w = self.params["weight"]
        dx = norm_dx_kernel(kernels.layernorm_backward_input, dy, cache, w)
        if dx is not None:
            return dx, (xhat, dy)
        dxhat = dy * w.astype(dy.dtype, copy=False)
        # d/dx of (x - mean) * rstd, with both mean and rstd depending on x
        dx = dxhat - dxhat.mean(axis=-1, keepdims=True)
        dx -= xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True)
        dx *= rstd
        return dx, (xhat, dy)

    def backward_weight(self, wcache: object) -> None:
        xhat, dy = wcache
        dy2 = _rows(dy)
        dw, db = self.grads["weight"], self.grads["bias"]
        if kernels.fast(dy2, dw, db):
            kernels.layernorm_backward_weight(dy2, _rows(xhat), dw, db)
            return
        self.grads["weight"] += np.einsum("bc,bc->c", dy2, _rows(xhat))
        self.grads["bias"] += dy2.sum(axis=0)
        # a merged W keeps Layer's loop, serial's bits: gathering first for one kernel call is
        # slower (240 wide, 4 micro-batches of 64 rows: 24 us against 20; of 128: 33 against 20)

    def cost(self, rows: int, width: int, need_dx: bool = True) -> Cost:
        # F reads x, writes y and xhat (12);  B reads dy, xhat, writes dx (12);  W reads dy and
        # xhat (8).  Keeps xhat and one rstd per row.
        n = rows * self.dim
        c = self._base_cost(self.dim)
        c.elem_bytes.update(F=12 * n, B=12 * n, W=8 * n)
        c.kept_bytes = FLOAT * (n + rows)
        c.temporary_bytes = FLOAT * n
        return c
