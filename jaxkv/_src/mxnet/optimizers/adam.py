"""MXNet's Adam family as kernels of :class:`~jaxkv._src.mxnet.optimizers.optimizer.Optimizer`:
``Adam``."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._src.mxnet.optimizers import float32 as f32
from jaxkv._src.mxnet.optimizers.optimizer import (
    Optimizer,
    OptimizerArgumentError,
    Scalars,
    cast,
    clipped,
    number,
    register,
)

__all__ = ["Adam"]


@register
class Adam(Optimizer):
    """MXNet's Adam (``mx.optimizer.Adam``).

    At the key's ``t``-th update (``t`` counts from ``begin_num_update + 1``), MXNet's Python
    computes in float64 ``lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)`` and its kernel
    (``adam_update``), in float32::

        g = grad * rescale_grad + weight * wd
        g = clip(g, clip_gradient)                         # if clip_gradient > 0
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + ((1 - beta2) * g) * g          # row-sparse: see below
        weight = weight - (lr_t * mean) / (sqrt(var) + epsilon)

    The store computes ``lr_t`` as MXNet does, on the host in float64, and hands the kernel the
    float32 MXNet's ``adam_update`` parses from its decimal string (``float32.parsed``: an ulp
    from the nearest for about 1 rate in 100). An update called without
    ``scalars`` (an optax loop, a row-sparse push) computes it from the state's count in
    double-float32 arithmetic (about 44 bits), rounded once to float32: MXNet's float32
    ``lr_t`` except when that lies within about 2**-40 of a rounding boundary. Weight decay is
    added before clipping (unlike SGD), and epsilon is outside the square root.

    A row-sparse gradient (``transformation(row_sparse=True)``): with ``lazy_update=True``
    (default) only its rows change (weight, mean, var; weight decay too), and MXNet's kernel
    computes ``(1 - beta2) * (g * g)`` when clipping; with ``lazy_update=False`` every row
    changes and the kernel computes ``(1 - beta2) * (g * g)``.

    Args:
      learning_rate: the learning rate (default 0.001; with a scheduler it replaces the
        scheduler's ``base_lr``, as in MXNet).
      beta1: decay of the first moment, in [0, 1).
      beta2: decay of the second moment, in [0, 1).
      epsilon: added to ``sqrt(var)``.
      lazy_update: whether a row-sparse gradient updates only its rows.
      **kwargs: :class:`Optimizer`'s arguments.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.Adam(learning_rate=0.1).transformation()
      >>> w = jnp.zeros(2)
      >>> updates, state = tx.update(jnp.array([3.0, -0.5]), tx.init(w), w)
      >>> optax.apply_updates(w, updates), state.count  # float32's 1 - beta2: not quite 0.1
      (Array([-0.10000065,  0.1000006 ], dtype=float32), Array(1, dtype=int32))
    """

    SCALARS: ClassVar[tuple[str, ...]] = ("lr", "wd", "rescale_grad", "clip_gradient", "epsilon")
    TEXT_SCALARS: ClassVar[frozenset[str]] = frozenset(SCALARS)  # adam_update's parameters
    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"beta1", "beta2"}

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        lazy_update: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = number("Adam", "beta1", beta1)
        self.beta2 = number("Adam", "beta2", beta2)
        self.epsilon = number("Adam", "epsilon", epsilon)
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise OptimizerArgumentError(
                    f"Adam: {name} expected in [0, 1), given {beta!r} (MXNet's bias correction "
                    "divides by zero or takes the root of a negative number)"
                )
        self.lazy_update = bool(lazy_update)

    def _repr_args(self) -> dict[str, object]:
        return {
            "learning_rate": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "epsilon": self.epsilon,
            "lazy_update": self.lazy_update,
        }

    def slot_names(self) -> tuple[str, ...]:
        return ("mean", "var")

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (*super().inputs(index), self.epsilon)

    def scalars(self, index: Any) -> tuple[float, ...]:
        lr, *rest = self.inputs(index)
        t = self._index_update_count[index]
        coef1 = 1.0 - self.beta1**t
        coef2 = 1.0 - self.beta2**t
        return (lr * (math.sqrt(coef2) / coef1), *rest)

    def traced_scalars(self, inputs: tuple[float, ...], t: jax.Array, z: jax.Array) -> dict:
        s = super().traced_scalars(inputs, t, z)
        s["lr"] = f32.bias_corrected_lr(inputs[0], self.beta1, self.beta2, t, z)
        return s

    def kernel(
        self,
        g: jax.Array,
        w: jax.Array,
        slots: tuple[jax.Array, ...],
        s: Scalars,
        t: jax.Array,
        z: jax.Array,
        row_sparse: bool,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        d = w.dtype
        m, v = slots
        r = lambda x: f32.rounded(x, z)  # noqa: E731 - each product rounded, as MXNet's
        c = cast(s["clip_gradient"], d)
        g = r(g * cast(s["rescale_grad"], d)) + r(w * cast(s["wd"], d))
        g = clipped(g, c)
        one = np.ones((), d)
        b1, b2 = f32.constant(self.beta1, d), f32.constant(self.beta2, d)
        m = r(b1 * m) + r((one - b1) * g)
        # MXNet's CPU kernels: (1 - beta2) * (g * g) in the standard row-sparse kernel, and in
        # the lazy one when clipping; ((1 - beta2) * g) * g otherwise.
        square_first = r((one - b2) * r(g * g))
        square_last = r(r((one - b2) * g) * g)
        if not row_sparse:
            square = square_last
        elif not self.lazy_update:
            square = square_first
        else:
            square = jnp.where(c >= 0, square_first, square_last)
        v = r(b2 * v) + square
        lr = cast(s["lr"], d)
        update = -(r(lr * m) / (jnp.sqrt(v) + cast(s["epsilon"], d)))
        return update, (m, v)
