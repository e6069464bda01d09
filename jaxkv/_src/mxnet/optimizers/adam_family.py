"""Adamax, Nadam, FTML and LAMB: MXNet 1.9.1's other Adam-like optimizers as kernels.

Each follows MXNet 1.9.1: its Python ``update`` on the host (:meth:`Optimizer.next_update`:
the learning rate, weight decay and what MXNet computes in float64 there), its C++ kernel or
NDArray expression in float32 in MXNet's order of operations. Adamax and Nadam are NDArray
expressions in MXNet: each scalar a float64 rounded once to float32, each operation rounded on
its own. FTML and LAMB pass the update count ``t`` to C++ kernels, which raise the betas to it
with C's ``powf`` (LAMB's two-phase kernels: ``pow`` in double, rounded to float): the store
computes those powers on the host with the platform's own ``powf`` and ``pow`` (``powf``),
as MXNet's kernels do. ``powf`` is not correctly rounded: glibc's differs from the correctly
rounded float32 power in about 0.5% of ``(beta, t)`` (``0.999f ** 2958``, for one), so
computing the power any other way would move some weights.

None of the four has a row-sparse kernel in MXNet: a row-sparse gradient is densified (every
row of the weight and the state moves), so ``lazy_update`` is False for all of them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._src.mxnet.optimizers import float32 as f32
from jaxkv._src.mxnet.optimizers.momentum import mx_clip, reaching
from jaxkv._src.mxnet.optimizers.optimizer import (
    ABSENT,
    Optimizer,
    OptimizerArgumentError,
    Scalars,
    cast,
    clipped,
    number,
    register,
)

__all__ = ["FTML", "LAMB", "Adamax", "Nadam", "pow_double", "powf"]

# The largest float32 below 2**31: an update count as C++'s float, back in int32.
_T_MAX = np.float32(2147483520.0)


@functools.cache
def _libm_powf() -> Callable[[float, float], float] | None:
    """C's ``powf`` from the platform's maths library, or None where ctypes cannot find it."""
    for name in (ctypes.util.find_library("m"), None):
        try:
            fn = ctypes.CDLL(name).powf
        except (OSError, AttributeError, TypeError):  # (TypeError: CDLL(None) on Windows)
            continue
        fn.restype = ctypes.c_float
        fn.argtypes = [ctypes.c_float, ctypes.c_float]
        return fn
    return None


def powf(base: float, exponent: float) -> float:
    """C's ``powf`` of ``base`` and ``exponent`` as float32s: what MXNet's float32 kernels
    compute for ``power`` (FTML's ``beta ** t``, ``multi_lamb_update``'s).

    The platform's own ``powf`` (through ctypes), as MXNet's library calls it; where it cannot
    be loaded, the correctly rounded float32 power (``float32(float64 power)``).

    Args:
      base: rounded to float32 first.
      exponent: rounded to float32 first (C++'s ``static_cast<float>(t)``).

    Returns:
      The float32 result, as a Python float.

    Examples:
      >>> from jaxkv._src.mxnet.optimizers.adam_family import powf
      >>> powf(0.5, 3)
      0.125
    """
    a, b = float(np.float32(base)), float(np.float32(exponent))
    fn = _libm_powf()
    if fn is None:
        return float(np.float32(a**b))
    return float(fn(a, b))


def pow_double(base: float, exponent: int) -> float:
    """C++'s ``std::pow(float, int)`` rounded to float: ``pow`` in double of the float32
    ``base`` (LAMB's two-phase kernels), the result rounded to float32, as a Python float."""
    return float(np.float32(float(np.float32(base)) ** int(exponent)))


def _traced_power(beta: float, t: jax.Array, z: jax.Array, *, float_t: bool) -> jax.Array:
    """``float32(beta32 ** t)`` inside the computation, correctly rounded (double-float32;
    ``beta32`` is ``beta`` as float32). ``float_t``: ``t`` as C++'s float first."""
    if float_t:
        t = jnp.minimum(t.astype(jnp.float32), _T_MAX).astype(jnp.int32)
    return f32.power(float(np.float32(beta)), t, z)[0]


def _opaque(s: dict, z: jax.Array) -> dict:
    """The scalars with their bits or-ed with the opaque zero: XLA cannot fold what it cannot
    see is a constant (a division by a constant becomes a product with its reciprocal)."""
    return {k: f32.rounded(jnp.asarray(v, jnp.float32), z) for k, v in s.items()}


def _beta(owner: str, name: str, value: object, *, closed: bool = False) -> float:
    beta = number(owner, name, value)
    if not (0.0 <= beta <= 1.0 if closed else 0.0 <= beta < 1.0):
        interval = "[0, 1]" if closed else "[0, 1)"
        raise OptimizerArgumentError(
            f"{owner}: {name} expected in {interval}, given {value!r} (outside it 1 - beta**t, "
            "which MXNet's update divides by, is 0 for some t, or the averages grow instead of "
            "decaying)"
        )
    return beta


def _maximum(a: jax.Array, b: jax.Array) -> jax.Array:
    """MXNet's ``maximum``: ``a`` if it is NaN, else ``a if a > b else b``."""
    return jnp.where(jnp.isnan(a) | (a > b), a, b)


def _clip_arg(clip: float | None) -> tuple[float, float]:
    """``(clip_gradient, clipping)`` for MXNet's NDArray ``clip``, which clips whenever
    ``clip_gradient`` is not None (0 and negative values too)."""
    return (0.0, 0.0) if clip is None else (clip, 1.0)


@register
class Adamax(Optimizer):
    """MXNet's AdaMax (``mx.optimizer.Adamax``): Adam with the infinity norm.

    At the key's ``t``-th update, MXNet's Python computes ``lr_t = lr / (1 - beta1**t)`` in
    float64, then runs an NDArray expression, in float32 (every scalar rounded once to float32,
    ``1 - beta1`` too; clipped whenever ``clip_gradient`` is not None, 0 and negative values
    too, as MXNet's ``clip`` operator)::

        g = grad * rescale_grad + weight * wd
        g = clip(g, -clip_gradient, clip_gradient)
        mean = mean * beta1 + g * (1 - beta1)
        u = maximum(u * beta2, abs(g))
        weight = weight - (mean * lr_t) / u

    Bit for bit through a store (``lr_t`` from the host). Called without ``scalars`` (an optax
    loop, a row-sparse push), ``lr_t`` is computed from the state's count in double-float32
    (about 44 bits) and rounded once: MXNet's float32 ``lr_t`` except within about 2**-40 of
    a rounding boundary. Where ``u`` is 0 (a gradient of exactly 0 at the first update; every
    gradient with ``clip_gradient=0``), the weight becomes NaN (0 / 0), as in MXNet.

    A row-sparse gradient: MXNet's expression densifies it (``g * rescale_grad + wd * weight``
    is dense), every row moves (``lazy_update`` is False).

    Args:
      learning_rate: the learning rate (default 0.002).
      beta1: decay of the mean, in [0, 1).
      beta2: decay of the infinity norm, in [0, 1].
      **kwargs: :class:`Optimizer`'s arguments.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.Adamax(learning_rate=0.1).transformation()
      >>> w = jnp.zeros(2)
      >>> updates, state = tx.update(jnp.array([3.0, -0.5]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)  # lr_t * ((1 - beta1) * g) / |g|: lr * sign(g)
      Array([-0.1,  0.1], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = ("lr", "wd", "rescale_grad", "clip_gradient", "clipping")
    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"beta1", "beta2"}

    def __init__(
        self,
        learning_rate: float = 0.002,
        beta1: float = 0.9,
        beta2: float = 0.999,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = _beta("Adamax", "beta1", beta1)
        self.beta2 = _beta("Adamax", "beta2", beta2, closed=True)
        self.lazy_update = False  # MXNet's expression densifies a row-sparse gradient

    def _repr_args(self) -> dict[str, object]:
        return {"learning_rate": self.lr, "beta1": self.beta1, "beta2": self.beta2}

    def slot_names(self) -> tuple[str, ...]:
        return ("mean", "u")

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (
            self._get_lr(index),
            self._get_wd(index),
            self.rescale_grad,
            *_clip_arg(self.clip_gradient),
        )

    def scalars(self, index: Any) -> tuple[float, ...]:
        lr, *rest = self.inputs(index)
        t = self._index_update_count[index]
        return (lr / (1.0 - self.beta1**t), *rest)

    def traced_scalars(self, inputs: tuple[float, ...], t: jax.Array, z: jax.Array) -> dict:
        s = super().traced_scalars(inputs, t, z)
        rest = f32.sub(f32.pair(1.0), f32.power(self.beta1, t, z), z)
        s["lr"] = f32.div(f32.pair(inputs[0]), rest, z)[0]
        return _opaque(s, z)

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
        r = lambda x: f32.rounded(x, z)  # noqa: E731 - each product rounded, as MXNet's
        mean, u = slots
        c = cast(s["clip_gradient"], d)
        g = r(g * cast(s["rescale_grad"], d)) + r(w * cast(s["wd"], d))
        g = jnp.where(cast(s["clipping"], d) != 0, mx_clip(g, -c, c), g)
        mean = r(mean * f32.constant(self.beta1, d)) + r(g * f32.constant(1.0 - self.beta1, d))
        u = _maximum(r(u * f32.constant(self.beta2, d)), jnp.abs(g))
        return -(r(mean * cast(s["lr"], d)) / u), (mean, u)


# Nadam's coefficients, in its SCALARS order after the flag "scheduled".
_NADAM_COEFFICIENTS = (
    "momentum_rest",  # 1 - momentum_t
    "momentum_next",  # momentum_t_1
    "schedule_rest",  # 1 - m_schedule
    "schedule_next_rest",  # 1 - m_schedule * momentum_t_1
    "beta2_rest",  # 1 - beta2**t
)
_LOG_096 = math.log(0.96)


@register
class Nadam(Optimizer):
    """MXNet's Nesterov Adam (``mx.optimizer.Nadam``).

    At each update of any key (``t`` that key's count), MXNet's Python computes in float64
    ``momentum_t = beta1 * (1 - 0.5 * 0.96**(t * schedule_decay))``, ``momentum_t_1`` (the same
    at ``t + 1``), ``m_schedule = m_schedule * momentum_t`` and
    ``m_schedule_next = m_schedule * momentum_t_1``, where ``m_schedule`` is the optimizer's,
    one product over every update of every key (not per key: the order in which keys are
    updated changes the numbers, as in MXNet). Then, in float32 (each scalar rounded once;
    clipped whenever ``clip_gradient`` is not None)::

        g = clip(grad * rescale_grad + weight * wd)
        mean = mean * beta1 + g * (1 - beta1)
        var = var * beta2 + (g * (1 - beta2)) * g
        g_prime = g / (1 - m_schedule)
        mean_prime = mean / (1 - m_schedule_next)
        var_prime = var / (1 - beta2**t)
        mean_bar = g_prime * (1 - momentum_t) + mean_prime * momentum_t_1
        weight = weight - (mean_bar * lr) / (sqrt(var_prime) + epsilon)

    Through a store the host keeps ``m_schedule`` and computes every coefficient in float64 as
    MXNet does: bit for bit. A row-sparse push (MXNet densifies the gradient, every row moves:
    ``lazy_update`` is False) compiles the key's coefficients in (``inputs``), so it is
    exact too, and compiles anew at each push.

    Called without ``scalars`` in an optax loop (no store), the update cannot know MXNet's
    optimizer-wide product: it uses the state's own, ``m_schedule`` as the product of
    ``momentum_i`` over this state's updates (``i`` from ``begin_num_update + 1`` to ``t``),
    which is MXNet's when the optimizer updates that one key and nothing else. It is computed
    in float32 from a closed form of the product (the logarithm of ``1 - 0.5 * q**i`` summed as
    a series over ``i``, ``q = 0.96**schedule_decay``), so the coefficients are within a few
    float32 ulps of MXNet's float64 ones (rounded to float32), and the weights follow within
    about 1e-6 relative, not bit for bit.

    Args:
      learning_rate: the learning rate (default 0.001).
      beta1: decay of the mean, in [0, 1).
      beta2: decay of the variance, in [0, 1).
      epsilon: added to ``sqrt(var_prime)``.
      schedule_decay: the momentum schedule's decay, >= 0.
      **kwargs: :class:`Optimizer`'s arguments.

    Raises:
      KVStoreError: (``OptimizerArgumentError``) a beta outside [0, 1), or a negative
        ``schedule_decay`` (``0.96**(t * decay)`` grows without bound: a momentum below
        ``-beta1`` after a few steps).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> opt = optimizer.Nadam(learning_rate=0.1)
      >>> tx = opt.transformation()
      >>> w = jnp.zeros(2)
      >>> scalars = opt.next_update([0])[0]  # the host's numbers for an update of index 0
      >>> updates, state = tx.update(jnp.array([3.0, -0.5]), tx.init(w), w, scalars=scalars)
      >>> optax.apply_updates(w, updates), round(opt.m_schedule, 6)
      (Array([-0.10564519,  0.10564518], dtype=float32), 0.450073)
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "clipping",
        "epsilon",
        "scheduled",
        *_NADAM_COEFFICIENTS,
    )
    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"beta1", "beta2", "schedule_decay"}

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        schedule_decay: float = 0.004,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = _beta("Nadam", "beta1", beta1)
        self.beta2 = _beta("Nadam", "beta2", beta2)
        self.epsilon = number("Nadam", "epsilon", epsilon)
        decay = number("Nadam", "schedule_decay", schedule_decay)
        if decay < 0:
            raise OptimizerArgumentError(
                f"Nadam: schedule_decay expected >= 0, given {schedule_decay!r} (0.96**(t * "
                "schedule_decay) then grows without bound and the momentum schedule turns "
                "negative)"
            )
        self.schedule_decay = decay
        self.m_schedule = 1.0
        self._coefficients: dict = {}  # index -> its latest update's coefficients (float64)
        self.lazy_update = False  # MXNet's expression densifies a row-sparse gradient

    def _repr_args(self) -> dict[str, object]:
        return {
            "learning_rate": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "epsilon": self.epsilon,
            "schedule_decay": self.schedule_decay,
        }

    def slot_names(self) -> tuple[str, ...]:
        return ("mean", "var")

    def _momentum(self, t: int) -> float:
        return self.beta1 * (1.0 - 0.5 * (pow(0.96, t * self.schedule_decay)))

    def _advance(self, index: Any) -> None:
        # MXNet's Nadam.update: the optimizer's m_schedule moves at every update of any key.
        t = self._index_update_count[index]
        momentum_t, momentum_t_1 = self._momentum(t), self._momentum(t + 1)
        self.m_schedule = self.m_schedule * momentum_t
        m_schedule_next = self.m_schedule * momentum_t_1
        self._coefficients[index] = (
            1.0 - momentum_t,
            momentum_t_1,
            1.0 - self.m_schedule,
            1.0 - m_schedule_next,
            1.0 - pow(self.beta2, t),
        )

    def _host_state(self) -> Any:
        return (self.m_schedule, dict(self._coefficients))

    def _host_scalars(self) -> Any:
        return self.m_schedule

    def _set_host_scalars(self, scalars: Any) -> None:
        self.m_schedule = scalars

    def _host_entry(self, index: Any) -> Any:
        return self._coefficients.get(index, ABSENT)

    def _set_host_entry(self, index: Any, entry: Any) -> None:
        if entry is ABSENT:
            self._coefficients.pop(index, None)
        else:
            self._coefficients[index] = entry

    def _set_host_state(self, state: Any) -> None:
        self.m_schedule, coefficients = state
        self._coefficients = dict(coefficients)

    def inputs(self, index: Any) -> tuple[float, ...]:
        """As :meth:`Optimizer.inputs`, then ``epsilon`` and, for an index updated already,
        the coefficients of its latest update (``scheduled`` 1; else 0 and zeros: the update
        then works out its own, see the class)."""
        own = (
            self._get_lr(index),
            self._get_wd(index),
            self.rescale_grad,
            *_clip_arg(self.clip_gradient),
            self.epsilon,
        )
        coefficients = None if index is None else self._coefficients.get(index)
        if coefficients is None:
            return (*own, 0.0, *(0.0 for _ in _NADAM_COEFFICIENTS))
        return (*own, 1.0, *coefficients)

    def traced_scalars(self, inputs: tuple[float, ...], t: jax.Array, z: jax.Array) -> dict:
        s = super().traced_scalars(inputs, t, z)
        if inputs[self.SCALARS.index("scheduled")]:
            return _opaque(s, z)  # the host's float64 coefficients, compiled in
        f = np.float32  # host constants
        r = lambda x: f32.rounded(x, z)  # noqa: E731 - the same numbers eagerly and under jit
        one = np.ones((), f)
        decay = f(self.schedule_decay * _LOG_096)  # log of q = 0.96**schedule_decay

        def rest(i: jax.Array) -> jax.Array:  # 1 - momentum_i = (1 - beta1) + beta1/2 * q**i
            q_i = jnp.exp(r(i.astype(f) * decay))
            return f(1.0 - self.beta1) + r(f(0.5 * self.beta1) * q_i)

        first = jnp.asarray(self.begin_num_update + 1, jnp.int32)
        n = (t - first + 1).astype(f)  # this state's updates, >= 1
        # log prod_{i=first}^{t} (1 - q**i / 2) = -sum_k (1/2)**k / k * sum_i q**(i k)
        k = np.arange(1, 49, dtype=f)
        if decay == 0:  # q = 1 (in float32): each factor is 1/2
            series = r(n * f(math.log(0.5)))
        else:  # the constant factors on the host (XLA would fold a division into a product)
            k64 = k.astype(np.float64)
            outer = (np.exp2(-k64) / k64 / np.expm1(float(decay) * k64)).astype(f)
            geometric = r(
                jnp.exp(r(r(first.astype(f) * decay) * k)) * jnp.expm1(r(r(n * decay) * k))
            )
            series = -jnp.sum(r(outer * geometric))
        log_beta1 = f(math.log(self.beta1)) if self.beta1 > 0 else f(-np.inf)
        schedule = jnp.exp(r(n * log_beta1) + series)
        momentum_t_1 = one - rest(t + 1)
        s["momentum_rest"] = rest(t)
        s["momentum_next"] = momentum_t_1
        s["schedule_rest"] = one - schedule
        s["schedule_next_rest"] = one - r(schedule * momentum_t_1)
        s["beta2_rest"] = f32.sub(f32.pair(1.0), f32.power(self.beta2, t, z), z)[0]
        return _opaque(s, z)

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
        r = lambda x: f32.rounded(x, z)  # noqa: E731 - each product rounded, as MXNet's
        mean, var = slots
        c = cast(s["clip_gradient"], d)
        g = r(g * cast(s["rescale_grad"], d)) + r(w * cast(s["wd"], d))
        g = jnp.where(cast(s["clipping"], d) != 0, mx_clip(g, -c, c), g)
        b1, b2 = self.beta1, self.beta2
        mean = r(mean * f32.constant(b1, d)) + r(g * f32.constant(1.0 - b1, d))
        var = r(var * f32.constant(b2, d)) + r(r(g * f32.constant(1.0 - b2, d)) * g)
        g_prime = f32.over(g, cast(s["schedule_rest"], d), z)
        mean_prime = f32.over(mean, cast(s["schedule_next_rest"], d), z)
        var_prime = f32.over(var, cast(s["beta2_rest"], d), z)
        mean_bar = r(g_prime * cast(s["momentum_rest"], d)) + r(
            mean_prime * cast(s["momentum_next"], d)
        )
        below = jnp.sqrt(var_prime) + cast(s["epsilon"], d)
        return -(r(mean_bar * cast(s["lr"], d)) / below), (mean, var)


@register
class FTML(Optimizer):
    """MXNet's Follow The Moving Leader (``mx.optimizer.FTML``).

    MXNet's ``ftml_update`` kernel, in float32 (``lr``, ``wd``, ``epsilon``, the betas and
    ``t`` as C++ floats; clipped when ``clip_gradient`` is set and >= 0, as MXNet passes it
    only when truthy), at the key's ``t``-th update::

        g = clip(rescale_grad * grad + wd * weight)
        v = beta2 * v + (1 - beta2) * (g * g)
        d_t = ((1 - powf(beta1, t)) / lr) * (sqrt(v / (1 - powf(beta2, t))) + epsilon)
        z = (beta1 * z + (1 - beta1) * g) - (d_t - beta1 * d) * weight
        d = d_t
        weight = -z / d_t

    Through a store the powers are the platform's ``powf`` on the host (``powf``), as
    MXNet's kernel computes them. The new weight ``-z / d_t`` is not ``weight + step``: the
    update is the float32 ``u`` for which ``weight + u`` is that weight
    (``opt_momentum.reaching``), MXNet's bits wherever one exists;
    where none does (a weight crossing zero or at least doubling), ``weight + u`` is the
    nearest float32 it can reach, within an ulp of the step.

    Called without ``scalars`` (an optax loop, a row-sparse push), the powers are computed
    correctly rounded from the state's count: glibc's ``powf`` differs from that by an ulp at
    about 0.5% of ``(beta, t)``, and there ``d_t`` may move by an ulp. A row-sparse gradient
    is densified, as MXNet's storage fallback does (``lazy_update`` is False).

    Args:
      beta1: decay of ``d`` and ``z``, in [0, 1).
      beta2: decay of ``v``, in [0, 1).
      epsilon: added to the root.
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.FTML(learning_rate=0.1).transformation()
      >>> w = jnp.ones(2)
      >>> updates, state = tx.update(jnp.array([3.0, -0.5]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)  # (1 - beta1) * lr * g / |g|: lr * sign(g)
      Array([0.90000004, 1.1       ], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "epsilon",
        "beta1_t",
        "beta2_t",
    )
    # ftml_update's float parameters (beta**t is worked out on the host: see kernel)
    TEXT_SCALARS: ClassVar[frozenset[str]] = frozenset(SCALARS[:5])
    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"beta1", "beta2"}

    def __init__(
        self, beta1: float = 0.6, beta2: float = 0.999, epsilon: float = 1e-8, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.beta1 = _beta("FTML", "beta1", beta1)
        self.beta2 = _beta("FTML", "beta2", beta2)
        self.epsilon = number("FTML", "epsilon", epsilon)
        self.lazy_update = False  # no row-sparse kernel: MXNet densifies the gradient

    def _repr_args(self) -> dict[str, object]:
        return {
            "learning_rate": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "epsilon": self.epsilon,
        }

    def slot_names(self) -> tuple[str, ...]:
        return ("d", "v", "z")  # MXNet's state order

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (*super().inputs(index), self.epsilon)

    def scalars(self, index: Any) -> tuple[float, ...]:
        t = self._index_update_count[index]
        return (*self.inputs(index), powf(self.beta1, t), powf(self.beta2, t))

    def traced_scalars(self, inputs: tuple[float, ...], t: jax.Array, z: jax.Array) -> dict:
        s = super().traced_scalars(inputs, t, z)
        s["beta1_t"] = _traced_power(self.beta1, t, z, float_t=True)
        s["beta2_t"] = _traced_power(self.beta2, t, z, float_t=True)
        return _opaque(s, z)

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
        dt = w.dtype
        r = lambda x: f32.rounded(x, z)  # noqa: E731 - each product rounded, as MXNet's
        d, v, zz = slots
        one = np.ones((), dt)
        b1, b2 = f32.constant(self.beta1, dt), f32.constant(self.beta2, dt)
        g = r(cast(s["rescale_grad"], dt) * g) + r(cast(s["wd"], dt) * w)
        g = clipped(g, cast(s["clip_gradient"], dt))
        v = r(b2 * v) + r((one - b2) * r(g * g))
        root = jnp.sqrt(f32.over(v, one - cast(s["beta2_t"], dt), z)) + cast(s["epsilon"], dt)
        d_t = r(((one - cast(s["beta1_t"], dt)) / cast(s["lr"], dt)) * root)
        zz = (r(b1 * zz) + r((one - b1) * g)) - r((d_t - r(b1 * d)) * w)
        return reaching(w, -zz / d_t, z), (d_t, v, zz)


@register
class LAMB(Optimizer):
    """MXNet's LAMB (``mx.optimizer.LAMB``): layer-wise adaptive moments.

    MXNet's store always runs LAMB through its updater's aggregation (``aggregate_num``, from
    ``MXNET_OPTIMIZER_AGGREGATION_SIZE``, 45 by default), so a key pushed alone or in a list
    runs ``multi_lamb_update``, in float32 (betas, epsilon and bounds as C++ floats; ``t`` the
    key's update count as a float; ``clip_gradient`` applied when set and >= 0)::

        g = clip(grad * rescale_grad)
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + ((1 - beta2) * g) * g
        mean_hat = mean / (1 - powf(beta1, t))            # bias_correction (else mean, var)
        var_hat = var / (1 - powf(beta2, t))
        step = mean_hat / (sqrt(var_hat) + epsilon) + wd * weight   # in double, then float
        r1 = sqrt(sum(weight * weight)), r2 = sqrt(sum(step * step))
        r1 = max(r1, lower_bound), min(r1, upper_bound)   # the bounds that are set and >= 0
        weight = weight - (lr * (r1 / r2 if r1 and r2 else 1)) * step

    ``step`` is computed in C's double (``sqrt`` of a float there is the double ``sqrt``) and
    rounded once to float32; jaxkv computes it in double-float32 (about 44 bits) and rounds
    once: MXNet's except where it lies within about 2**-44 of a rounding boundary (about one
    element in a million). The powers are the platform's ``powf`` on the host
    (``powf``), as MXNet's kernel computes them.

    With ``aggregate_num`` set to 1 (as MXNet reads it), MXNet runs its two-phase kernels
    instead, and so does jaxkv: ``lamb_update_phase1`` (``beta**t`` as C++'s ``std::pow`` of
    a float and an int, in double; ``mean / (1. - beta1**t)`` in double; the rest in float,
    ``sqrt`` too) and ``lamb_update_phase2`` (``r1`` and ``r2`` the weight's and step's
    ``norm()``, the rate ``(lr * r1) / r2``).

    The mean and var are MXNet's bit for bit. ``r1`` and ``r2`` are sums over the whole key,
    which MXNet adds one element after the other (``norm()``: with a running scale); XLA adds
    them in another order, so the trust ratio, and the weight with it, may differ from
    MXNet's by a float32 ulp or so: within 1e-6 relative, not bit for bit. Called without
    ``scalars`` (an optax loop, a row-sparse push), the powers are correctly rounded from the
    state's count (glibc's ``powf`` differs by an ulp at about 0.5% of ``(beta, t)``).

    A row-sparse gradient is densified, as MXNet's storage fallback does (``lazy_update`` is
    False). float16 weights are refused (MXNet runs the kernels in half precision, or, with
    ``multi_precision``, takes ``r1`` of the float16 weights while the kernel runs on the
    float32 copy, which jaxkv's kernel does not see).

    Args:
      learning_rate: the learning rate (default 0.001).
      beta1: decay of the mean, in [0, 1).
      beta2: decay of the variance, in [0, 1).
      epsilon: added to ``sqrt(var_hat)``.
      lower_bound: the least ``r1`` (``None`` or 0: none).
      upper_bound: the largest ``r1`` (``None`` or 0: none).
      bias_correction: whether to divide by ``1 - beta**t``.
      **kwargs: :class:`Optimizer`'s arguments.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.LAMB(learning_rate=0.1).transformation()
      >>> w = jnp.array([3.0, 4.0])
      >>> updates, state = tx.update(jnp.array([1.0, -1.0]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)  # step ~ sign(g): |w| / |step| = 5 / sqrt(2)
      Array([2.6464467, 4.3535533], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "epsilon",
        "lower_bound",
        "upper_bound",
        "beta1_t",
        "beta2_t",
    )
    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {
        "beta1",
        "beta2",
        "bias_correction",
        "aggregate_num",
    }

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-6,
        lower_bound: float | None = None,
        upper_bound: float | None = None,
        bias_correction: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = _beta("LAMB", "beta1", beta1)
        self.beta2 = _beta("LAMB", "beta2", beta2)
        self.epsilon = number("LAMB", "epsilon", epsilon)
        for name, bound in (("lower_bound", lower_bound), ("upper_bound", upper_bound)):
            if bound is not None:
                number("LAMB", name, bound)
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.upper_bound = None if upper_bound is None else float(upper_bound)
        self.bias_correction = bool(bias_correction)
        size = os.getenv("MXNET_OPTIMIZER_AGGREGATION_SIZE", "45")
        try:
            self.aggregate_num = max(1, min(45, int(size)))
        except ValueError:
            raise OptimizerArgumentError(
                f"LAMB: MXNET_OPTIMIZER_AGGREGATION_SIZE expected an integer, given {size!r} "
                "(MXNet raises ValueError)"
            ) from None
        self.lazy_update = False  # no row-sparse kernel: MXNet densifies the gradient

    def _repr_args(self) -> dict[str, object]:
        args: dict[str, object] = {
            "learning_rate": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "epsilon": self.epsilon,
        }
        for name in ("lower_bound", "upper_bound"):
            if getattr(self, name) is not None:
                args[name] = getattr(self, name)
        if not self.bias_correction:
            args["bias_correction"] = False
        return args

    def slot_names(self) -> tuple[str, ...]:
        return ("mean", "var")

    def check_weight(self, w: jax.Array) -> None:
        super().check_weight(w)
        if jnp.result_type(w) == jnp.float16:
            raise OptimizerArgumentError(
                "LAMB: float16 weights: MXNet's LAMB then runs its kernels in half precision "
                "or, with multi_precision=True, takes the trust ratio's weight norm from the "
                "float16 weights while updating the float32 copy, which jaxkv's kernel (run "
                "on the copy) does not see; expected float32 weights"
            )

    def inputs(self, index: Any) -> tuple[float, ...]:
        # MXNet passes each bound only when it is truthy (the kernel's default -1: none).
        return (
            *super().inputs(index),
            self.epsilon,
            self.lower_bound if self.lower_bound else -1.0,
            self.upper_bound if self.upper_bound else -1.0,
        )

    def _phases(self) -> bool:
        """Whether MXNet runs the two-phase kernels (``aggregate_num <= 1``)."""
        return self.aggregate_num <= 1

    def scalars(self, index: Any) -> tuple[float, ...]:
        t = self._index_update_count[index]
        power = pow_double if self._phases() else powf
        return (*self.inputs(index), power(self.beta1, t), power(self.beta2, t))

    def traced_scalars(self, inputs: tuple[float, ...], t: jax.Array, z: jax.Array) -> dict:
        s = super().traced_scalars(inputs, t, z)
        float_t = not self._phases()  # multi_lamb_update: t as a float; std::pow: an int
        s["beta1_t"] = _traced_power(self.beta1, t, z, float_t=float_t)
        s["beta2_t"] = _traced_power(self.beta2, t, z, float_t=float_t)
        return _opaque(s, z)

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
        r = lambda x: f32.rounded(x, z)  # noqa: E731 - each product rounded, as MXNet's
        mean, var = slots
        one = np.ones((), d)
        b1, b2 = f32.constant(self.beta1, d), f32.constant(self.beta2, d)
        g = clipped(r(g * cast(s["rescale_grad"], d)), cast(s["clip_gradient"], d))
        mean = r(b1 * mean) + r((one - b1) * g)
        var = r(b2 * var) + r(r((one - b2) * g) * g)
        decay = r(cast(s["wd"], d) * w)
        eps = cast(s["epsilon"], d)
        p1, p2 = cast(s["beta1_t"], d), cast(s["beta2_t"], d)
        lower, upper = cast(s["lower_bound"], d), cast(s["upper_bound"], d)
        lr = cast(s["lr"], d)
        if self._phases():  # lamb_update_phase1 and phase2
            if self.bias_correction:
                # mean / (1. - beta1_t) in double: 1 - beta1_t exact as a pair
                rest = f32.two_sum(jnp.asarray(one), -p1, z)
                mean_hat = f32.div((mean, jnp.zeros_like(mean)), rest, z)[0]
                step = r(mean_hat / (jnp.sqrt(f32.over(var, one - p2, z)) + eps)) + decay
            else:
                step = r(mean / (jnp.sqrt(var) + eps)) + decay
            r1, r2 = self._norm(w, z), self._norm(step, z)
            r1 = jnp.where(lower >= 0, _maximum(r1, lower), r1)
            r1 = jnp.where(upper >= 0, jnp.where(jnp.isnan(r1) | (r1 < upper), r1, upper), r1)
            lr = jnp.where((r1 == 0) | (r2 == 0), lr, r(lr * r1) / r2)
            return -r(lr * step), (mean, var)
        # multi_lamb_update
        if self.bias_correction:
            mean_hat, var_hat = f32.over(mean, one - p1, z), f32.over(var, one - p2, z)
        else:
            mean_hat, var_hat = mean, var
        step = _double_step(mean_hat, var_hat, eps, decay, z)
        r1, r2 = self._norm(w, z), self._norm(step, z)
        r1 = jnp.where(lower >= 0, jnp.where(r1 < lower, lower, r1), r1)  # std::max
        r1 = jnp.where(upper >= 0, jnp.where(upper < r1, upper, r1), r1)  # std::min
        ratio = jnp.where((r1 == 0) | (r2 == 0), jnp.ones_like(r1), r1 / r2)
        return -r(r(lr * ratio) * step), (mean, var)

    @staticmethod
    def _norm(x: jax.Array, z: jax.Array) -> jax.Array:
        """``sqrt(sum(x * x))`` in float32 (MXNet's order of summation differs: see the
        class)."""
        return jnp.sqrt(f32.sum_of_squares(x, z))


def _double_step(
    mean: jax.Array, var: jax.Array, eps: jax.Array, decay: jax.Array, z: jax.Array
) -> jax.Array:
    """``float(mean / (sqrt(var) + eps) + decay)`` computed in double, as
    ``multi_lamb_update``'s C++ does (``sqrt`` of a float there is the double one): in
    double-float32 pairs, rounded once to float32."""
    zero = jnp.zeros_like(mean)
    root = f32.sqrt_pair((var, zero), z)
    below = f32.sub(root, (-eps * jnp.ones_like(mean), zero), z)
    quotient = f32.div((mean, zero), below, z)
    return f32.sub(quotient, (-decay, zero), z)[0]
