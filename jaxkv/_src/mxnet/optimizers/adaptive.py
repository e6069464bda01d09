"""AdaGrad, GroupAdaGrad, RMSProp, AdaDelta and Ftrl: MXNet's adaptive-rate optimizers as kernels.

Each follows MXNet 1.9.1: its Python ``update`` on the host (:meth:`Optimizer.next_update`:
the learning rate, weight decay and the optimizer's own numbers, as float32 scalars of the
computation), and its kernel in float32 in MXNet's order of operations: a C++ kernel
(``rmsprop_update``, ``rmspropalex_update``, ``ftrl_update``, the row-sparse
``adagrad_update`` and ``group_adagrad_update``), or MXNet's NDArray expression, each operation
rounded on its own (AdaGrad's and GroupAdaGrad's dense updates, AdaDelta). MXNet's NDArray
expressions clip the gradient whenever ``clip_gradient`` is not None (0 and negative values
too, as MXNet's ``clip`` operator); its C++ kernels get it only when it is truthy and clip
when it is >= 0.

Row-sparse gradients: AdaGrad, GroupAdaGrad and Ftrl run MXNet's row-sparse kernels on the
pushed rows only (``lazy_update`` is True); RMSProp and AdaDelta have none, and MXNet densifies
the gradient: every row moves (``lazy_update`` is False).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._src.mxnet.optimizers import float32 as f32
from jaxkv._src.mxnet.optimizers.momentum import mx_clip, reaching, sign
from jaxkv._src.mxnet.optimizers.optimizer import (
    Optimizer,
    OptimizerArgumentError,
    Scalars,
    cast,
    clipped,
    number,
    rate,
    register,
)

__all__ = ["AdaDelta", "AdaGrad", "Ftrl", "GroupAdaGrad", "RMSProp"]


def _clip_inputs(clip: float | None) -> tuple[float, float]:
    """``clip_gradient`` for a kernel that runs both of MXNet's clippings: the value (-1 for
    None) and whether MXNet's NDArray expression clips (whenever it is not None)."""
    return (-1.0 if clip is None else clip), (0.0 if clip is None else 1.0)


def _ndarray_clip(g: jax.Array, s: Scalars) -> jax.Array:
    """MXNet's ``clip(g, -clip_gradient, clip_gradient)`` where ``clip_gradient`` is not None
    (its NDArray expressions: any value, 0 and negative too)."""
    c = cast(s["clip_gradient"], g.dtype)
    return jnp.where(cast(s["clipping"], g.dtype) != 0, mx_clip(g, -c, c), g)


def _kernel_clip(g: jax.Array, s: Scalars) -> jax.Array:
    """The clipping of a C++ kernel that takes ``clip_gradient`` when it is truthy and clips
    when it is >= 0: only a positive value clips."""
    c = cast(s["clip_gradient"], g.dtype)
    return jnp.where(c > 0, clipped(g, c), g)


def _optional(owner: str, name: str, value: object) -> float | None:
    return None if value is None else number(owner, name, value)


@register
class AdaGrad(Optimizer):
    """MXNet's AdaGrad (``mx.optimizer.AdaGrad``).

    A dense gradient, MXNet's NDArray expression (each operation rounded to float32)::

        g = clip(grad * rescale_grad, clip_gradient)      # if clip_gradient is not None
        history = history + g * g
        weight = weight + (g / sqrt(history + eps) + weight * wd) * (-lr)

    A row-sparse gradient (``transformation(row_sparse=True)``), MXNet's
    ``_sparse_adagrad_update`` on the pushed rows only (history too)::

        g = clip(grad * rescale_grad, clip_gradient)      # if clip_gradient > 0
        history = history + g * g
        weight = weight - (g / sqrt(history + eps)) * lr

    Bit for bit. MXNet's row-sparse kernel takes no weight decay: a row-sparse push with a
    weight decay other than 0 (after ``wd_mult``) is refused, where MXNet's store swallows
    the error and leaves the weight as it was.

    Args:
      eps: added to the history under the square root.
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01).

    Raises:
      KVStoreError: (``OptimizerArgumentError``) a row-sparse update with weight decay.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.AdaGrad(learning_rate=0.5).transformation()
      >>> w = jnp.ones(2)
      >>> state = tx.init(w)
      >>> for g in ([3.0, -1.0], [4.0, 0.0]):
      ...     updates, state = tx.update(jnp.array(g), state, w)
      ...     w = optax.apply_updates(w, updates)
      >>> w, state.slots[0]  # 1 - 0.5 * (1 + 4/5), 1 + 0.5; the history of squares
      (Array([0.09999999, 1.5       ], dtype=float32), Array([25.,  1.], dtype=float32))
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "clipping",
        "epsilon",
    )

    def __init__(self, eps: float = 1e-7, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.float_stable_eps = number("AdaGrad", "eps", eps)
        self.lazy_update = True  # _sparse_adagrad_update: the pushed rows only

    def _repr_args(self) -> dict[str, object]:
        return {"learning_rate": self.lr, "eps": self.float_stable_eps}

    def slot_names(self) -> tuple[str, ...]:
        return ("history",)

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (
            self._get_lr(index),
            self._get_wd(index),
            self.rescale_grad,
            *_clip_inputs(self.clip_gradient),
            self.float_stable_eps,
        )

    def check_row_sparse(self, inputs: tuple[float, ...]) -> None:
        wd = inputs[1]
        if wd != 0:
            raise OptimizerArgumentError(
                f"AdaGrad: row-sparse gradients with weight decay: wd expected 0 (after "
                f"wd_mult), given {wd!r}: MXNet's sparse adagrad_update takes none (its "
                "store swallows the error and leaves the weight as it was)"
            )

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
        r = lambda x: f32.rounded(x, z)  # noqa: E731 - each operation rounded, as MXNet's
        lr, eps = cast(s["lr"], d), cast(s["epsilon"], d)
        g = r(g * cast(s["rescale_grad"], d))
        g = _kernel_clip(g, s) if row_sparse else _ndarray_clip(g, s)
        history = r(slots[0] + r(g * g))
        div = r(g / f32.root(r(history + eps), z))
        if row_sparse:  # weight - div * lr
            return -r(div * lr), (history,)
        return r(r(div + r(w * cast(s["wd"], d))) * -lr), (history,)


def _kahan_rows(x: jax.Array, z: jax.Array) -> jax.Array:
    """The sum of each row of ``x`` (2-D), as MXNet's ``sum``/``mean`` reduce one on a CPU: the
    elements in order, with Kahan's compensation (``mshadow::red::sum``)."""
    r = lambda v: f32.rounded(v, z)  # noqa: E731 - kept apart: (t - s) - y is not 0

    def add(carry: tuple, column: jax.Array) -> tuple[tuple, None]:
        total, residual = carry
        y = r(column - residual)
        t = r(total + y)
        return (t, r(r(t - total) - y)), None

    zero = jnp.zeros(x.shape[:1], x.dtype)
    (total, _), _ = jax.lax.scan(add, (zero, zero), x.T)
    return total


def _plain_rows(x: jax.Array, z: jax.Array) -> jax.Array:
    """The sum of each row of ``x`` (2-D), the elements added in order (a C++ loop's)."""

    def add(total: jax.Array, column: jax.Array) -> tuple[jax.Array, None]:
        return f32.rounded(total + column, z), None

    total, _ = jax.lax.scan(add, jnp.zeros(x.shape[:1], x.dtype), x.T)
    return total


@register
class GroupAdaGrad(Optimizer):
    """MXNet's AdaGrad with one learning rate per row (``mx.optimizer.contrib.GroupAdaGrad``,
    registered as ``'groupadagrad'``), for 2-D weights.

    A dense gradient, MXNet's NDArray expression (each operation rounded to float32)::

        g = clip(grad * rescale_grad, clip_gradient)      # if clip_gradient is not None
        history = history + mean(g * g, axis=1, keepdims=True)
        weight = weight - (lr * g) / sqrt(history + eps)

    where ``mean`` adds each row's squares in order with Kahan's compensation, then divides by
    the row's length, as MXNet's CPU reduction. A row-sparse gradient
    (``transformation(row_sparse=True)``), MXNet's ``group_adagrad_update`` on the pushed rows
    only: the same, except the squares are added in order without compensation, and the
    gradient clipped only if ``clip_gradient > 0``. Bit for bit.

    MXNet keeps one history number per row (shape ``(rows, 1)``); jaxkv keeps it in every
    element of the row (the weight's shape, as much memory as the weight): a store packs,
    shards and gathers a parameter's state laid out as the parameter.

    Refused, as MXNet asserts: weights that are not 2-D, and a weight decay other than 0 (after
    ``wd_mult``; refused before the update is counted, where MXNet's store swallows its
    assertion and leaves the weight as it was).

    Args:
      eps: added to the history under the square root.
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01).

    Raises:
      KVStoreError: (``OptimizerArgumentError``) a weight that is not 2-D, or an update with
        weight decay.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.GroupAdaGrad(learning_rate=1.0, eps=0.0).transformation()
      >>> w = jnp.zeros((2, 2))
      >>> state = tx.init(w)
      >>> updates, state = tx.update(jnp.array([[3.0, -1.0], [0.0, 2.0]]), state, w)
      >>> optax.apply_updates(w, updates), state.slots[0]  # a row's rate: 1 / sqrt(mean g**2)
      (Array([[-1.3416407,  0.4472136],
             [ 0.       , -1.4142135]], dtype=float32), Array([[5., 5.],
             [2., 2.]], dtype=float32))
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "clipping",
        "epsilon",
    )

    def __init__(self, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.float_stable_eps = number("GroupAdaGrad", "eps", eps)
        self.lazy_update = True  # group_adagrad_update: the pushed rows only

    def _repr_args(self) -> dict[str, object]:
        return {"learning_rate": self.lr, "eps": self.float_stable_eps}

    def slot_names(self) -> tuple[str, ...]:
        return ("history",)

    def check_weight(self, w: jax.Array) -> None:
        super().check_weight(w)
        if jnp.ndim(w) != 2:
            raise OptimizerArgumentError(
                f"GroupAdaGrad: expected 2-D weights (one history per row; MXNet asserts "
                f"len(weight.shape) == 2), given shape {tuple(jnp.shape(w))}"
            )

    @staticmethod
    def _no_weight_decay(wd: float, index: Any) -> None:
        if wd != 0:
            raise OptimizerArgumentError(
                f"GroupAdaGrad: wd expected 0 (after wd_mult) for index {index!r}, given "
                f"{wd!r}: MXNet's GroupAdaGrad takes no weight decay (it asserts wd == 0, and "
                "its store swallows the error and leaves the weight as it was)"
            )

    def next_update(self, indices: list) -> np.ndarray:
        for index in indices:  # refused before anything is counted
            self._no_weight_decay(self._get_wd(index), index)
        return super().next_update(indices)

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (
            self._get_lr(index),
            self._get_wd(index),  # only ever 0: refused otherwise, as MXNet
            self.rescale_grad,
            *_clip_inputs(self.clip_gradient),
            self.float_stable_eps,
        )

    def traced_scalars(self, inputs: tuple[float, ...], t: jax.Array, z: jax.Array) -> dict:
        self._no_weight_decay(inputs[1], None)  # an update without scalars: the numbers given
        return super().traced_scalars(inputs, t, z)

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
        if w.ndim != 2:
            self.check_weight(w)
        d = w.dtype
        r = lambda x: f32.rounded(x, z)  # noqa: E731
        g = r(g * cast(s["rescale_grad"], d))
        g = _kernel_clip(g, s) if row_sparse else _ndarray_clip(g, s)
        squares = r(g * g)
        total = _plain_rows(squares, z) if row_sparse else _kahan_rows(squares, z)
        mean = r(f32.over(total, np.asarray(w.shape[1], d), z))
        history = r(slots[0] + mean[:, None])  # every element of a row: the row's history
        below = f32.root(r(history + cast(s["epsilon"], d)), z)
        return -r(r(cast(s["lr"], d) * g) / below), (history,)


@register
class RMSProp(Optimizer):
    """MXNet's RMSProp (``mx.optimizer.RMSProp``): Tieleman and Hinton's, or with
    ``centered=True`` Graves's.

    With ``gamma1``, ``gamma2``, ``epsilon`` and the rest as float32 (MXNet's kernels take
    C++ floats), ``rmsprop_update``::

        g = rescale_grad * grad + wd * weight
        g = clip(g, clip_gradient)                         # if clip_gradient > 0
        n = (1 - gamma1) * (g * g) + gamma1 * n
        weight = weight - lr * (g / sqrt(n + epsilon))

    and with ``centered=True``, ``rmspropalex_update``::

        n = ((1 - gamma1) * g) * g + gamma1 * n
        mean = (1 - gamma1) * g + gamma1 * mean
        delta = gamma2 * delta - (lr * g) / sqrt((n - mean * mean) + epsilon)
        weight = weight + delta

    Then, if ``clip_weights > 0``, the new weight is clipped to ``[-clip_weights,
    clip_weights]``. Bit for bit without ``clip_weights``. With it, MXNet writes the clipped
    weight whole, and the update is the float32 ``u`` for which ``weight + u`` is it: MXNet's
    bits wherever a float32 update reaches them (every weight clipped after a step of less
    than half of ``clip_weights``); where none does (a larger step to the bound: a large
    learning rate, or a starting weight far outside the range), within an ulp of the step.

    The state: ``(n,)``, or ``(n, mean, delta)`` centered (MXNet's ``n``, ``g``, ``delta``).
    A row-sparse gradient: MXNet has no row-sparse kernel and runs this one on the densified
    gradient, every row (``lazy_update`` is False).

    Args:
      learning_rate: the learning rate (default 0.001; with a scheduler it replaces the
        scheduler's ``base_lr``, as in MXNet).
      gamma1: the decay of the mean square (and of the mean, centered).
      gamma2: the momentum of ``delta`` (centered only).
      epsilon: added under the square root.
      centered: Graves's version (3 state arrays) or not (1).
      clip_weights: clip the new weight to ``[-clip_weights, clip_weights]`` (``None``, 0 or
        negative: not clipped, as MXNet).
      **kwargs: :class:`Optimizer`'s arguments.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.RMSProp(learning_rate=0.1, gamma1=0.5).transformation()
      >>> w = jnp.zeros(2)
      >>> updates, state = tx.update(jnp.array([3.0, -0.5]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)  # -lr * g / sqrt(0.5 * g**2)
      Array([-0.14142136,  0.14142135], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "gamma1",
        "gamma2",
        "epsilon",
        "clip_weights",
    )
    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"centered"}

    def __init__(
        self,
        learning_rate: float = 0.001,
        gamma1: float = 0.9,
        gamma2: float = 0.9,
        epsilon: float = 1e-8,
        centered: bool = False,
        clip_weights: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.gamma1 = number("RMSProp", "gamma1", gamma1)
        self.gamma2 = number("RMSProp", "gamma2", gamma2)
        self.centered = bool(centered)
        self.epsilon = number("RMSProp", "epsilon", epsilon)
        self.clip_weights = _optional("RMSProp", "clip_weights", clip_weights)
        self.lazy_update = False  # no row-sparse kernel: MXNet densifies the gradient

    def _repr_args(self) -> dict[str, object]:
        args: dict[str, object] = {
            "learning_rate": self.lr,
            "gamma1": self.gamma1,
            "gamma2": self.gamma2,
            "epsilon": self.epsilon,
            "centered": self.centered,
        }
        if self.clip_weights is not None:
            args["clip_weights"] = self.clip_weights
        return args

    def slot_names(self) -> tuple[str, ...]:
        return ("n", "mean", "delta") if self.centered else ("n",)

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (
            *super().inputs(index),
            self.gamma1,
            self.gamma2,
            self.epsilon,
            self.clip_weights if self.clip_weights else -1.0,
        )

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
        r = lambda x: f32.rounded(x, z)  # noqa: E731
        lr, gamma1, eps = cast(s["lr"], d), cast(s["gamma1"], d), cast(s["epsilon"], d)
        g = r(r(cast(s["rescale_grad"], d) * g) + r(cast(s["wd"], d) * w))
        g = clipped(g, cast(s["clip_gradient"], d))
        rest = r(np.ones((), d) - gamma1)
        if not self.centered:
            n = r(r(rest * r(g * g)) + r(gamma1 * slots[0]))
            step = -r(lr * r(g / f32.root(r(n + eps), z)))
            new_slots: tuple[jax.Array, ...] = (n,)
        else:
            n = r(r(r(rest * g) * g) + r(gamma1 * slots[0]))
            mean = r(r(rest * g) + r(gamma1 * slots[1]))
            below = f32.root(r(r(n - r(mean * mean)) + eps), z)
            step = r(r(cast(s["gamma2"], d) * slots[2]) - r(r(lr * g) / below))
            new_slots = (n, mean, step)
        bound = cast(s["clip_weights"], d)
        new = clipped(r(w + step), bound)
        return jnp.where(bound >= 0, reaching(w, new, z), step), new_slots


@register
class AdaDelta(Optimizer):
    """MXNet's AdaDelta (``mx.optimizer.AdaDelta``).

    MXNet's NDArray expression, each operation rounded to float32 (``1 - rho`` computed in
    float64 by MXNet's Python, then rounded)::

        g = clip(grad * rescale_grad, clip_gradient)      # if clip_gradient is not None
        acc_g = acc_g * rho + ((1 - rho) * g) * g
        delta = (sqrt(acc_delta + epsilon) / sqrt(acc_g + epsilon)) * g
        acc_delta = acc_delta * rho + ((1 - rho) * delta) * delta
        weight = weight - (delta + weight * wd)

    Bit for bit. The learning rate is not used (nor a schedule called), as in MXNet. A
    row-sparse gradient: MXNet's expression densifies it (the accumulators decay and weight
    decay applies in every row): every row moves (``lazy_update`` is False).

    Args:
      rho: the decay of both accumulators.
      epsilon: added under both square roots.
      **kwargs: :class:`Optimizer`'s arguments.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.AdaDelta(rho=0.5, epsilon=0.01).transformation()
      >>> w = jnp.zeros(2)
      >>> updates, state = tx.update(jnp.array([1.0, -3.0]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)  # -sqrt(eps / (0.5 * g**2 + eps)) * g
      Array([-0.140028  ,  0.14126448], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "wd",
        "rescale_grad",
        "clip_gradient",
        "clipping",
        "rho",
        "one_minus_rho",
        "epsilon",
    )

    def __init__(self, rho: float = 0.90, epsilon: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rho = number("AdaDelta", "rho", rho)
        self.epsilon = number("AdaDelta", "epsilon", epsilon)
        self.lazy_update = False  # MXNet's expression densifies a row-sparse gradient

    def _repr_args(self) -> dict[str, object]:
        return {"rho": self.rho, "epsilon": self.epsilon}

    def slot_names(self) -> tuple[str, ...]:
        return ("acc_g", "acc_delta")

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (
            self._get_wd(index),
            self.rescale_grad,
            *_clip_inputs(self.clip_gradient),
            self.rho,
            1.0 - self.rho,
            self.epsilon,
        )

    def check_row_sparse(self, inputs: tuple[float, ...]) -> None:
        _, _, clip, clipping, *_ = inputs
        if clipping and clip < 0:
            raise OptimizerArgumentError(
                f"AdaDelta: row-sparse gradients with clip_gradient={clip!r}: expected "
                "clip_gradient None or >= 0: MXNet's clip of a row-sparse gradient needs "
                "bounds around 0 (it raises 'Operator not implemented', and its store "
                "swallows the error and leaves the weight as it was)"
            )

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
        r = lambda x: f32.rounded(x, z)  # noqa: E731
        rho, rest, eps = cast(s["rho"], d), cast(s["one_minus_rho"], d), cast(s["epsilon"], d)
        g = _ndarray_clip(r(g * cast(s["rescale_grad"], d)), s)
        acc_g = r(r(slots[0] * rho) + r(r(rest * g) * g))
        delta = r(r(f32.root(r(slots[1] + eps), z) / f32.root(r(acc_g + eps), z)) * g)
        acc_delta = r(r(slots[1] * rho) + r(r(rest * delta) * delta))
        return -r(delta + r(w * cast(s["wd"], d))), (acc_g, acc_delta)


@register
class Ftrl(Optimizer):
    """MXNet's FTRL-Proximal (``mx.optimizer.Ftrl``).

    MXNet's ``ftrl_update``, in float32::

        g = clip(grad * rescale_grad, clip_gradient)      # if clip_gradient > 0
        z = z + (g - ((sqrt(n + g * g) - sqrt(n)) * weight) / lr)
        n = n + g * g
        weight = ((sign(z) * lamda1 - z) / ((beta + sqrt(n)) / lr + wd)) * (abs(z) > lamda1)

    MXNet writes the new weight from scratch, not ``weight + step``: the update is the float32
    ``u`` for which ``weight + u`` is it, MXNet's bits wherever a float32 update reaches them.
    Where none does (the new weight less than about half the size of the step: a weight that
    shrinks a lot, or changes sign), ``weight + u`` is within an ulp of the step of MXNet's.
    The state keeps the difference (``residual``: MXNet's weight minus ``weight + u``, exact,
    0 where reached), and the next update starts from ``weight + residual``, MXNet's weight:
    ``z`` and ``n``, and every weight reached, stay MXNet's bit for bit. A weight of zero is
    +0.0 where MXNet's may be -0.0.

    A row-sparse gradient: MXNet's lazy kernel (a row-sparse stored weight): only the pushed
    rows change (weight, ``z``, ``n``). MXNet runs that kernel for a weight stored
    ``row_sparse``; for one stored dense it densifies the gradient, which recomputes every
    row's weight from its ``z`` and ``n`` (0 for a row never pushed): jaxkv's store keeps no
    storage type and updates the pushed rows.

    Args:
      lamda1: the L1 regularisation coefficient.
      learning_rate: the learning rate (default 0.1; MXNet gives it to no schedule: a
        scheduler keeps its ``base_lr``).
      beta: the per-coordinate learning-rate parameter.
      **kwargs: :class:`Optimizer`'s arguments.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.Ftrl(learning_rate=1.0, lamda1=0.5).transformation()
      >>> w = jnp.zeros(3)
      >>> updates, state = tx.update(jnp.array([3.0, -0.25, -1.0]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)  # (sign(z) * 0.5 - z) / (1 + |g|); 0 where |z| <= 0.5
      Array([-0.625,  0.   ,  0.25 ], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "lamda1",
        "beta",
    )

    def __init__(
        self, lamda1: float = 0.01, learning_rate: float = 0.1, beta: float = 1, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)  # as MXNet: learning_rate replaces no schedule's base_lr
        self.lamda1 = number("Ftrl", "lamda1", lamda1)
        self.beta = number("Ftrl", "beta", beta)
        self.lr = rate("Ftrl", "learning_rate", learning_rate)
        self.lazy_update = True  # ftrl_update's row-sparse kernel: the pushed rows only

    def _repr_args(self) -> dict[str, object]:
        return {"lamda1": self.lamda1, "learning_rate": self.lr, "beta": self.beta}

    def slot_names(self) -> tuple[str, ...]:
        return ("z", "n", "residual")

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (*super().inputs(index), self.lamda1, self.beta)

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
        r = lambda x: f32.rounded(x, z)  # noqa: E731
        lr, lamda1 = cast(s["lr"], d), cast(s["lamda1"], d)
        zs, n, residual = slots
        g = clipped(r(g * cast(s["rescale_grad"], d)), cast(s["clip_gradient"], d))
        weight = r(w + residual)  # MXNet's weight
        square = r(g * g)
        grown = r(f32.root(r(n + square), z) - f32.root(n, z))
        zs = r(zs + r(g - r(f32.over(r(grown * weight), lr, z))))
        n = r(n + square)
        below = r(r(f32.over(r(cast(s["beta"], d) + f32.root(n, z)), lr, z)) + cast(s["wd"], d))
        kept = (jnp.abs(zs) > lamda1).astype(d)
        new = r(r(r(r(sign(zs) * lamda1) - zs) / below) * kept)
        u = reaching(w, new, z)
        return u, (zs, n, r(new - r(w + u)))
