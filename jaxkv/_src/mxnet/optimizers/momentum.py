"""NAG, Signum, SGLD, DCASGD, LARS and LBSGD: MXNet's other SGD-like optimizers as kernels.

Each follows MXNet 1.9.1: its Python ``update`` on the host (:meth:`Optimizer.next_update`),
its C++ kernel or NDArray expression in float32 in MXNet's order of operations. Where MXNet
writes a new weight that is not ``weight + step`` (``sgd_update``'s ``(1 - lr*wd)*w - step``,
``nag_mom_update``, ``signsgd_update``, ``signum_update``, SGLD's noise added to a weight
already moved), the update is the float32 ``u`` for which ``w + u`` is that weight
(:func:`reaching`): the same bits, except where no float32 ``u`` reaches it. ``w + u`` moves
in steps of ``u``'s ulp, so that needs a step at least half as large as the new weight (a
weight that crosses zero or at least doubles), and there ``w + u`` is the nearest float32 it
can reach: within an ulp of the step (of the new weight, when both lie in one binade).
"""

from __future__ import annotations

import contextvars
import logging
import math
import zlib
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv._src.mxnet import random
from jaxkv._src.mxnet.optimizers import float32 as f32
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
from jaxkv._src.mxnet.optimizers.sgd import sgd_step

__all__ = ["DCASGD", "LARS", "LBSGD", "NAG", "SGLD", "Signum", "reaching"]

logger = logging.getLogger("jaxkv")


def reaching(w: jax.Array, target: jax.Array, z: jax.Array) -> jax.Array:
    """The update ``u`` for which ``w + u`` (one float addition) is ``target``.

    ``target - w`` rounded, or the float next to it on either side where that one reaches
    ``target``; where none does, the one whose sum is nearest. ``w + u`` moves in steps of
    ``u``'s ulp (and rounds ties to even): finer than ``target``'s wherever
    ``|target - w| < |target| / 2``, and there one of the three reaches it.

    Args:
      w: the weight.
      target: MXNet's new weight, of ``w``'s shape and dtype.
      z: an opaque int32 zero (:func:`float32.rounded`).

    Returns:
      The update, of ``w``'s dtype.
    """
    r = lambda x: f32.rounded(x, z)  # noqa: E731
    u = r(target - w)
    up = jnp.nextafter(u, jnp.full_like(u, jnp.inf))
    down = jnp.nextafter(u, jnp.full_like(u, -jnp.inf))
    miss = [jnp.abs(r(w + c) - target) for c in (u, up, down)]
    best = jnp.where(miss[1] < miss[0], up, u)
    best = jnp.where(miss[2] < jnp.minimum(miss[0], miss[1]), down, best)
    return jnp.where(r(w + u) == target, u, best)  # (NaN, infinities: u itself)


def sign(x: jax.Array) -> jax.Array:
    """C++'s ``(x > 0) - (x < 0)``, in ``x``'s dtype: 1, -1 or 0 (0 for NaN)."""
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


def mx_clip(x: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """MXNet's ``clip`` operator: ``hi`` where ``x > hi``, else ``lo`` where ``x < lo``, else
    ``x`` (NaN kept), for any bounds (MXNet's NDArray optimizers clip when ``clip_gradient`` is
    not None, 0 and negative values too)."""
    return jnp.where(x > hi, hi, jnp.where(x < lo, lo, x))


def sgd_update(
    g: jax.Array, w: jax.Array, s: Scalars, z: jax.Array, lr: jax.Array | None = None
) -> jax.Array:
    """MXNet's ``sgd_update`` (and its lazy row-sparse kernel) as an update: the new weight
    ``(1 - lr*wd) * w - step`` (:func:`~jaxkv._src.mxnet.optimizers.sgd.sgd_step`), which is
    ``w - step`` exactly when ``wd`` is 0. ``lr``: a learning rate other than ``s['lr']``."""
    d = w.dtype
    r = lambda x: f32.rounded(x, z)  # noqa: E731
    s = dict(s) if lr is None else {**s, "lr": lr}
    lr_, wd = cast(s["lr"], d), cast(s["wd"], d)
    step = sgd_step(g, s, z)
    new = r(r(r(np.ones((), d) - r(lr_ * wd)) * w) - step)
    return jnp.where(wd == 0, -step, reaching(w, new, z))


def _momentum_arg(owner: str, momentum: object) -> float:
    m = number(owner, "momentum", momentum)
    if m < 0:
        raise OptimizerArgumentError(
            f"{owner}: momentum expected >= 0 (MXNet keeps a state for a negative one but "
            f"runs its kernel without momentum), given {momentum!r}"
        )
    return m


@register
class NAG(Optimizer):
    """MXNet's Nesterov accelerated gradient (``mx.optimizer.NAG``).

    With momentum, MXNet's ``nag_mom_update``, in float32 (``g`` clipped after rescaling when
    ``clip_gradient > 0``)::

        mom = momentum * mom
        weight = (weight - mom) + (momentum + 1) * (mom - lr * (rescale_grad * grad + wd * weight))
        mom = mom - lr * (rescale_grad * grad + wd * weight)   # the new weight: MXNet's in place

    Without momentum (0, the default, and no state), ``sgd_update``:
    ``weight = (1 - lr * wd) * weight - lr * rescale_grad * grad``. Both write a new weight,
    not ``weight + step``: the update is the float32 ``u`` for which ``weight + u`` is that
    weight, MXNet's bits, wherever one exists. Where none does (``weight + u`` moves in steps
    of ``u``'s ulp: a weight that crosses zero or at least doubles), ``weight + u`` is the
    nearest float32 it can reach, within an ulp of the step. Exact without weight decay and
    momentum.

    A row-sparse gradient: without momentum, MXNet's lazy row-sparse ``sgd_update`` (only the
    gradient's rows change, weight decay too: ``lazy_update`` is True); with momentum, MXNet
    has no row-sparse kernel and runs the dense one on the densified gradient (every row
    changes: ``lazy_update`` is False).

    Args:
      momentum: the momentum, >= 0 (0: none).
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.NAG(learning_rate=0.5, momentum=0.5).transformation()
      >>> w = jnp.ones(2)
      >>> state = tx.init(w)
      >>> for g in ([1.0, -1.0], [1.0, 1.0]):
      ...     updates, state = tx.update(jnp.array(g), state, w)
      ...     w = optax.apply_updates(w, updates)
      >>> w
      Array([-0.625,  1.125], dtype=float32)
    """

    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"momentum"}

    def __init__(self, momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = _momentum_arg("NAG", momentum)
        self.lazy_update = self.momentum == 0  # sgd_update's lazy row-sparse kernel

    def _repr_args(self) -> dict[str, object]:
        return {"learning_rate": self.lr, "momentum": self.momentum}

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum > 0 else ()

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
        if not slots:
            return sgd_update(g, w, s, z), ()
        d = w.dtype
        r = lambda x: f32.rounded(x, z)  # noqa: E731
        lr, wd, c = cast(s["lr"], d), cast(s["wd"], d), cast(s["clip_gradient"], d)
        m = f32.constant(self.momentum, d)
        scaled = r(cast(s["rescale_grad"], d) * g)
        scaled = jnp.where(c >= 0, clipped(scaled, c), scaled)
        kept = r(m * slots[0])
        new = r(r(w - kept) + r((m + np.ones((), d)) * r(kept - r(lr * r(scaled + r(wd * w))))))
        # MXNet writes the new weight in place first, then reads it for the momentum.
        mom = r(kept - r(lr * r(scaled + r(wd * new))))
        return reaching(w, new, z), (mom,)


@register
class Signum(Optimizer):
    """MXNet's Signum and signSGD (``mx.optimizer.Signum``).

    With momentum (0.9 by default), MXNet's ``signum_update``, in float32 (``g`` clipped after
    rescaling when ``clip_gradient > 0``; MXNet's state is the negated momentum)::

        mom = momentum * mom - ((1 - momentum) * wd) * weight - (1 - momentum) * g
        weight = (1 - lr * wd_lh) * weight + lr * sign(mom)

    With ``momentum=0``, no state, and ``signsgd_update``, which ignores ``rescale_grad``,
    ``clip_gradient`` (and ``wd_lh``: MXNet refuses it there, so does jaxkv)::

        weight = (1 - lr * wd) * weight - lr * sign(grad)

    The update reaches the new weight as :class:`NAG`'s does (MXNet's bits, except within an
    ulp of the step where the weight crosses zero or at least doubles; exact without
    ``wd_lh``, or ``wd`` for signSGD). A row-sparse gradient runs the dense kernel on the
    densified gradient, as MXNet (no row-sparse kernel): every row changes (``lazy_update``
    is False).

    Args:
      learning_rate: the learning rate (default 0.01).
      momentum: the momentum, >= 0 (0: signSGD).
      wd_lh: decoupled weight decay (Loshchilov and Hutter), with momentum only.
      **kwargs: :class:`Optimizer`'s arguments.

    Raises:
      KVStoreError: (``OptimizerArgumentError``) a negative momentum, or ``wd_lh`` without
        momentum.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.Signum(learning_rate=0.25).transformation()
      >>> w = jnp.zeros(3)
      >>> updates, state = tx.update(jnp.array([3.0, -0.5, 0.0]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)
      Array([-0.25,  0.25,  0.  ], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = ("lr", "wd", "rescale_grad", "clip_gradient", "wd_lh")
    TEXT_SCALARS: ClassVar[frozenset[str]] = frozenset(SCALARS)  # signsgd/signum_update's
    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"momentum"}

    def __init__(
        self,
        learning_rate: float = 0.01,
        momentum: float = 0.9,
        wd_lh: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = _momentum_arg("Signum", momentum)
        self.wd_lh = number("Signum", "wd_lh", wd_lh)
        if self.momentum == 0 and self.wd_lh:
            raise OptimizerArgumentError(
                f"Signum: wd_lh={wd_lh!r} with momentum=0: MXNet's signsgd_update takes no "
                "wd_lh (MXNetError: Cannot find argument 'wd_lh'), expected wd_lh=0 or a "
                "momentum > 0"
            )
        self.lazy_update = False  # no row-sparse kernel: MXNet densifies the gradient

    def _repr_args(self) -> dict[str, object]:
        return {"learning_rate": self.lr, "momentum": self.momentum, "wd_lh": self.wd_lh}

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum > 0 else ()

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (*super().inputs(index), self.wd_lh)

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
        lr, wd = cast(s["lr"], d), cast(s["wd"], d)
        one = np.ones((), d)
        if not slots:  # signsgd_update
            step = r(lr * sign(g))
            new = r(r(r(one - r(lr * wd)) * w) - step)
            return jnp.where(wd == 0, -step, reaching(w, new, z)), ()
        m = f32.constant(self.momentum, d)
        rest = one - m
        rescale, c = cast(s["rescale_grad"], d), cast(s["clip_gradient"], d)
        with_clip = r(rest * clipped(r(rescale * g), c))
        without = r(r(rest * rescale) * g)
        mom = r(r(m * slots[0]) - r(r(rest * wd) * w)) - jnp.where(c >= 0, with_clip, without)
        wd_lh = cast(s["wd_lh"], d)
        step = r(lr * sign(mom))
        new = r(r(r(one - r(lr * wd_lh)) * w) + step)
        return jnp.where(wd_lh == 0, step, reaching(w, new, z)), (mom,)


# The position of the parameter being updated in the tree of one SGLD update (its noise's own
# stream): counted while the update runs (per thread, per update).
_LEAF: contextvars.ContextVar[int] = contextvars.ContextVar("sgld_leaf", default=0)


def _drawn_word() -> int:
    """A 32-bit word drawn from ``mx.random``'s stream (the current device's, so
    ``mx.random.seed`` decides it), as two 16-bit halves."""
    hi, lo = (int(x) for x in random.randint(0, 1 << 16, shape=(2,)).asnumpy())
    return (hi << 16) | lo


@register
class SGLD(Optimizer):
    """MXNet's stochastic gradient Langevin dynamics (``mx.optimizer.SGLD``).

    MXNet's NDArray expression, in float32 (clipped whenever ``clip_gradient`` is not None,
    as MXNet's ``clip(g, -clip_gradient, clip_gradient)``, 0 and negative values too)::

        g = clip(grad * rescale_grad)
        weight = weight + (-lr / 2) * (g + wd * weight)
        weight = weight + normal(0, sqrt(lr))          # one draw per element

    The deterministic part is MXNet's to the bit; the noise has MXNet's distribution (normal,
    mean 0, standard deviation ``sqrt(lr)``, independent per element, key and update) but
    not MXNet's stream: it is drawn from a ``jax.random`` key made of a word the optimizer
    draws from ``mx.random`` when it is made (so ``mx.random.seed`` before decides it), the
    key's index (``crc32`` of its ``repr``), the key's update count and the parameter's
    position in the tree. So the same seed, optimizer and pushes give the same numbers, in
    every process alike, whatever order the keys are pushed in. The update reaches the noisy
    weight as :class:`NAG`'s does.

    A row-sparse gradient: MXNet's expression densifies it, every row moves (``lazy_update``
    is False).

    Args:
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01, >= 0).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.SGLD(learning_rate=0.01).transformation()
      >>> w = jnp.zeros(20000)
      >>> updates, _ = tx.update(jnp.zeros(20000), tx.init(w), w)
      >>> round(float(jnp.std(updates)), 2)  # sqrt(lr)
      0.1
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "neg_half_lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "clipping",
        "noise_scale",
        "seed_hi",
        "seed_lo",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lazy_update = False  # MXNet's expression densifies a row-sparse gradient
        self._seed = _drawn_word()

    def inputs(self, index: Any) -> tuple[float, ...]:
        lr, wd = self._get_lr(index), self._get_wd(index)
        if lr < 0:
            raise OptimizerArgumentError(
                f"SGLD: learning rate expected >= 0 (the noise's standard deviation is its "
                f"square root; MXNet raises ValueError), given {lr!r}"
            )
        clip = self.clip_gradient
        word = zlib.crc32(repr(index).encode(), self._seed)
        return (
            -lr / 2,
            wd,
            self.rescale_grad,
            0.0 if clip is None else clip,
            0.0 if clip is None else 1.0,
            math.sqrt(lr),
            float(word >> 16),
            float(word & 0xFFFF),
        )

    def _noise(self, key: jax.Array, shape: tuple, dtype: Any, scale: jax.Array) -> jax.Array:
        """MXNet's ``normal(0, scale, shape)``: ``scale`` times a standard normal draw."""
        return scale.astype(dtype) * jax.random.normal(key, shape, dtype)

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
        c = cast(s["clip_gradient"], d)
        g = r(g * cast(s["rescale_grad"], d))
        g = jnp.where(cast(s["clipping"], d) != 0, mx_clip(g, -c, c), g)
        moved = r(w + r(r(g + r(w * cast(s["wd"], d))) * cast(s["neg_half_lr"], d)))
        leaf = _LEAF.get()
        _LEAF.set(leaf + 1)
        hi = jnp.asarray(s["seed_hi"], jnp.float32).astype(jnp.uint32)
        lo = jnp.asarray(s["seed_lo"], jnp.float32).astype(jnp.uint32)
        words = jnp.stack([(hi << jnp.uint32(16)) | lo, t.astype(jnp.uint32)])
        key = jax.random.fold_in(jax.random.wrap_key_data(words, impl="threefry2x32"), leaf)
        noise = self._noise(key, w.shape, d, jnp.asarray(s["noise_scale"], jnp.float32))
        return reaching(w, r(moved + noise), z), ()

    def _build(
        self, row_sparse: bool, inputs: tuple[float, ...], master_hint: bool = False
    ) -> optax.GradientTransformationExtraArgs:
        inner = super()._build(row_sparse, inputs, master_hint)

        def update(updates: Any, state: Any, params: Any = None, **kwargs: Any) -> Any:
            token = _LEAF.set(0)  # the tree's parameters counted from 0 in this update
            try:
                return inner.update(updates, state, params, **kwargs)
            finally:
                _LEAF.reset(token)

        return optax.GradientTransformationExtraArgs(inner.init, update)


@register
class DCASGD(Optimizer):
    """MXNet's delay-compensated asynchronous SGD (``mx.optimizer.DCASGD``), without momentum.

    MXNet's NDArray expression, in float32, with the previous weight as state (the initial
    weight at first; clipped whenever ``clip_gradient`` is not None, as SGLD)::

        g = clip(grad * rescale_grad)
        step = (-lr) * ((g + wd * weight) + ((lamda * g) * g) * (weight - previous))
        previous = weight
        weight = weight + step

    Bit for bit. A row-sparse gradient: MXNet's expression densifies it, every row moves
    (``lazy_update`` is False).

    ``momentum`` other than 0 is refused: MXNet 1.9.1's ``DCASGD.update`` tests its momentum
    state with ``if mom:``, which raises for any state of more than one element (and fails
    its own assertion for one element), and MXNet's store swallows the error: with momentum
    MXNet never moves the weights, and its momentum formula has never run.

    Args:
      momentum: only 0.
      lamda: the delay-compensation coefficient.
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.DCASGD(learning_rate=0.5, lamda=1.0).transformation()
      >>> w = jnp.ones(2)
      >>> state = tx.init(w)
      >>> for g in ([1.0, -1.0], [2.0, 2.0]):
      ...     updates, state = tx.update(jnp.array(g), state, w)
      ...     w = optax.apply_updates(w, updates)
      >>> w
      Array([ 0.5, -0.5], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "clipping",
        "lamda",
    )

    def __init__(self, momentum: float = 0.0, lamda: float = 0.04, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = number("DCASGD", "momentum", momentum)
        if self.momentum != 0:
            raise OptimizerArgumentError(
                f"DCASGD: momentum expected 0, given {momentum!r}: MXNet 1.9.1's DCASGD "
                "raises inside its own update with a momentum state ('if mom:' on an "
                "NDArray) and its store swallows the error, so its weights never move; "
                "jaxkv has no numbers of MXNet's to give"
            )
        self.lamda = number("DCASGD", "lamda", lamda)
        self.weight_previous: dict = {}  # MXNet's attribute (its state holds the weights)
        self.lazy_update = False  # MXNet's expression densifies a row-sparse gradient

    def _repr_args(self) -> dict[str, object]:
        return {"learning_rate": self.lr, "momentum": self.momentum, "lamda": self.lamda}

    def slot_names(self) -> tuple[str, ...]:
        return ("previous_weight",)

    def init_slot(self, name: str, weight: jax.Array) -> jax.Array:  # noqa: ARG002
        return jnp.array(weight, copy=True)  # MXNet's weight.copy()

    def inputs(self, index: Any) -> tuple[float, ...]:
        clip = self.clip_gradient
        return (
            self._get_lr(index),
            self._get_wd(index),
            self.rescale_grad,
            0.0 if clip is None else clip,
            0.0 if clip is None else 1.0,
            self.lamda,
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
        c = cast(s["clip_gradient"], d)
        g = r(g * cast(s["rescale_grad"], d))
        g = jnp.where(cast(s["clipping"], d) != 0, mx_clip(g, -c, c), g)
        decayed = r(g + r(w * cast(s["wd"], d)))
        compensation = r(r(r(cast(s["lamda"], d) * g) * g) * r(w - slots[0]))
        step = r(r(decayed + compensation) * -cast(s["lr"], d))
        return step, (w,)


@register
class LARS(Optimizer):
    """MXNet's LARS (``mx.optimizer.LARS``): SGD with a learning rate scaled per parameter.

    For a dense gradient, MXNet's aggregated path (its default; ``multi_sum_sq``,
    ``multi_lars``, ``preloaded_multi_sgd_update`` / ``..._mom_update``), in float32::

        w_norm, g_norm = sqrt(sum(weight * weight)), sqrt(sum(grad * grad))
        if w_norm > 0 and g_norm > 0:                 # a parameter not named *gamma/beta/bias
            lr = lr * eta * w_norm / (g_norm * rescale_grad + wd * w_norm + eps)
        mom = momentum * mom - (lr * wd) * weight - lr * clip(rescale_grad * grad)
        weight = weight + mom

    With ``momentum_correction`` (default) and a changing learning rate, MXNet's Python
    scales the momentum by the base rate's ratio to the one of its previous update (of any
    key), on the host as MXNet. Weight decay multipliers follow LARS's own rule: a parameter
    named in ``param_idx2name`` without a ``_weight`` suffix gets 0.

    Not bit for bit: MXNet adds the squares one by one in float32, XLA in its own order, so
    the norms, and the scaled learning rate, may differ by a few float32 ulps (equal bits in
    most updates; within 1e-6 relative on the recorded ones). Everything else is MXNet's
    float32 arithmetic.

    Row-sparse gradients are refused: MXNet's LARS then takes the norm of the whole weight
    (a different path, in float64), while jaxkv's row-sparse kernels see the pushed rows. So
    are float16 weights under ``multi_precision=True``: MXNet takes the norms of the float16
    arrays, jaxkv's kernel runs on the float32 copy.

    Args:
      momentum: the momentum, >= 0 (0: none, and no state).
      lazy_update: MXNet's argument (row-sparse gradients are refused).
      eta: the LARS coefficient.
      eps: added to the denominator.
      momentum_correction: scale the momentum when the learning rate changes.
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.LARS(learning_rate=1.0, eta=0.5).transformation()
      >>> w = jnp.array([3.0, 4.0])
      >>> updates, _ = tx.update(jnp.array([0.0, 10.0]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)  # lr * eta * |w| / |g| = 0.25
      Array([3. , 1.5], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = (
        "lr",
        "wd",
        "rescale_grad",
        "clip_gradient",
        "momentum",
        "lars",
        "eta",
        "eps",
    )
    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"momentum"}

    def __init__(
        self,
        momentum: float = 0.0,
        lazy_update: bool = True,
        eta: float = 0.001,
        eps: float = 0,
        momentum_correction: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.momentum = _momentum_arg("LARS", momentum)
        self.momentum_correction = bool(momentum_correction)
        self.lazy_update = bool(lazy_update)
        self.eta = number("LARS", "eta", eta)
        self.eps = number("LARS", "eps", eps)
        self.skip = 0
        self.last_lr: float | None = None
        self.cur_lr: float | None = None

    def _repr_args(self) -> dict[str, object]:
        return {
            "learning_rate": self.lr,
            "momentum": self.momentum,
            "eta": self.eta,
            "eps": self.eps,
            "momentum_correction": self.momentum_correction,
        }

    def set_wd_mult(self, args_wd_mult: dict) -> None:
        """As :meth:`Optimizer.set_wd_mult`, with LARS's rule: parameters named without a
        ``_weight`` suffix get 0 unless given.

        Args:
          args_wd_mult: index or name -> multiplier; replaces all.
        """
        mult = {n: 0.0 for n in self.idx2name.values() if not str(n).endswith("_weight")}
        mult.update(args_wd_mult)
        self.wd_mult = mult

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum > 0 else ()

    def check_weight(self, w: jax.Array) -> None:
        super().check_weight(w)
        if self.multi_precision and jnp.result_type(w) == jnp.float16:
            raise OptimizerArgumentError(
                "LARS: multi_precision=True with a float16 weight: MXNet's LARS then takes "
                "the norms of the float16 weights and gradients, which jaxkv's kernel (run on "
                "the float32 copy) does not see; expected float32 weights or "
                "multi_precision=False"
            )

    def check_row_sparse(self, inputs: tuple[float, ...]) -> None:  # noqa: ARG002
        raise OptimizerArgumentError(
            "LARS: row-sparse gradients: MXNet's LARS then scales the learning rate by "
            "the norm of the whole weight (its non-aggregated path, in float64), which "
            "jaxkv's row-sparse kernels do not see; expected dense gradients"
        )

    def _advance(self, index: Any) -> None:  # noqa: ARG002 - the rate of any key
        # MXNet's LARS._get_lrs: the base rate of this update and of the one before.
        if self.cur_lr is not None:
            self.last_lr = self.cur_lr
        lr = self.lr_scheduler(self.num_update) if self.lr_scheduler is not None else self.lr
        if self.cur_lr is None:
            self.last_lr = lr
        self.cur_lr = lr

    def _host_state(self) -> Any:
        return (self.last_lr, self.cur_lr)

    def _host_scalars(self) -> Any:
        return (self.last_lr, self.cur_lr)

    def _set_host_scalars(self, scalars: Any) -> None:
        self.last_lr, self.cur_lr = scalars

    def _set_host_state(self, state: Any) -> None:
        self.last_lr, self.cur_lr = state

    def _scaled(self, index: Any) -> float:
        """1.0 where LARS scales the rate (not a name ending in gamma, beta or bias)."""
        name = str(self.idx2name.get(index, index))
        return 0.0 if name.endswith(("gamma", "beta", "bias")) else 1.0

    def inputs(self, index: Any) -> tuple[float, ...]:
        return (
            *super().inputs(index),
            self.momentum,
            self._scaled(index),
            self.eta,
            self.eps,
        )

    def scalars(self, index: Any) -> tuple[float, ...]:
        lr, wd, rescale, clip, momentum, *rest = self.inputs(index)
        if self.momentum_correction and self.last_lr != 0 and self.cur_lr is not None:
            momentum = momentum * (self.cur_lr / self.last_lr)  # type: ignore[operator]
        return (lr, wd, rescale, clip, momentum, *rest)

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
        lr, wd = jnp.asarray(s["lr"], jnp.float32), jnp.asarray(s["wd"], jnp.float32)
        w_norm = jnp.sqrt(f32.sum_of_squares(w, z))
        g_sq = f32.sum_of_squares(g, z)
        below = r(r(jnp.sqrt(g_sq) * jnp.asarray(s["rescale_grad"], jnp.float32)) + r(wd * w_norm))
        below = below + jnp.asarray(s["eps"], jnp.float32)
        scaled = r(r(lr * jnp.asarray(s["eta"], jnp.float32)) * w_norm) / below
        use = (w_norm > 0) & (g_sq > 0) & (jnp.asarray(s["lars"], jnp.float32) != 0)
        lr = jnp.where(use, scaled, lr)
        step = sgd_step(g, {**s, "lr": lr}, z)
        decay = r(r(cast(lr, d) * cast(wd, d)) * w)
        if not slots:
            return -decay - step, ()
        mom = r(cast(s["momentum"], d) * slots[0]) - decay - step
        return mom, (mom,)


_WARMUPS = ("linear", "power2", "sqrt", "lars")


@register
class LBSGD(Optimizer):
    """MXNet's large-batch SGD (``mx.optimizer.LBSGD``), with ``batch_scale=1``.

    MXNet reads the learning rate before counting the update (the schedule sees
    ``num_update`` of the update before), then runs ``sgd_mom_update`` (with momentum) or
    ``sgd_update`` (without; the update reaches its new weight, as :class:`NAG`'s), as
    :class:`SGD`'s formula; from the key's second update on, the gradient is MXNet's
    cumulated one, ``0 + grad`` (-0.0 becomes 0.0).

    The warm-up multiplies the learning rate by ``1 + (batch_scale - 1) * f(step)``, which
    is 1 with ``batch_scale=1`` for ``'linear'``, ``'power2'`` and ``'sqrt'``: those, and
    ``warmup_epochs``, ``updates_per_epoch``, ``begin_epoch`` and ``num_epochs``, change
    nothing, as in MXNet. ``'lars'`` multiplies it by
    ``clip(sqrt(|w|**2 / (|g|**2 + wd * |w|**2 + 1e-18)), 0.01, 100)``, which MXNet computes
    in float64 from NumPy's float32 sums of squares, and jaxkv in double-float32 from XLA's
    float32 sums: the sums add in another order, so the rate may differ by an ulp or so
    (within 1e-6 relative), not bit for bit. Everything else is bit for bit.

    A row-sparse gradient: MXNet's lazy row-sparse ``sgd_update`` / ``sgd_mom_update``, only
    the gradient's rows change (``'lars'`` refused there: it needs the whole weight).

    Refused: ``batch_scale`` other than 1. MXNet then sums gradients on the host and updates
    every ``batch_scale`` pushes, but its first sum keeps a reference to the store's merge
    buffer, which the next push overwrites: in a store with several devices the first large
    batch counts the second push's gradient twice and the first one never. jaxkv does not
    reproduce that, and gives no other numbers. Also refused: a ``warmup_strategy`` other than
    MXNet's four (MXNet ignores an unknown one).

    Args:
      momentum: the momentum, >= 0 (0: none, and no state).
      multi_precision: as :class:`Optimizer`'s.
      warmup_strategy: ``'linear'``, ``'power2'``, ``'sqrt'`` or ``'lars'``.
      warmup_epochs: MXNet's warm-up length in epochs (no effect with ``batch_scale=1``).
      batch_scale: only 1.
      updates_per_epoch: MXNet's updates per epoch (no effect with ``batch_scale=1``).
      begin_epoch: MXNet's first epoch (no effect with ``batch_scale=1``).
      num_epochs: MXNet's number of epochs (unused, as in MXNet).
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.LBSGD(learning_rate=0.5, momentum=0.5).transformation()
      >>> w = jnp.ones(2)
      >>> state = tx.init(w)
      >>> for g in ([1.0, -1.0], [1.0, 1.0]):
      ...     updates, state = tx.update(jnp.array(g), state, w)
      ...     w = optax.apply_updates(w, updates)
      >>> w
      Array([-0.25,  1.25], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = ("lr", "wd", "rescale_grad", "clip_gradient", "lr_lo")
    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"momentum", "warmup_strategy"}

    def __init__(
        self,
        momentum: float = 0.0,
        multi_precision: bool = False,
        warmup_strategy: str = "linear",
        warmup_epochs: int = 5,
        batch_scale: int = 1,
        updates_per_epoch: int = 32,
        begin_epoch: int = 0,
        num_epochs: int = 60,
        **kwargs: Any,
    ) -> None:
        super().__init__(multi_precision=multi_precision, **kwargs)
        self.momentum = _momentum_arg("LBSGD", momentum)
        if warmup_strategy not in _WARMUPS:
            raise OptimizerArgumentError(
                f"LBSGD: warmup_strategy expected one of {list(_WARMUPS)}, given "
                f"{warmup_strategy!r} (MXNet would silently use no warm-up)"
            )
        if number("LBSGD", "batch_scale", batch_scale) != 1:
            raise OptimizerArgumentError(
                f"LBSGD: batch_scale expected 1, given {batch_scale!r}: MXNet 1.9.1 sums "
                "the gradients of batch_scale pushes keeping a reference to its store's "
                "merge buffer for the first one, so through a store of several devices its "
                "first large batch counts the second gradient twice and the first never; "
                "jaxkv does not reproduce that and gives no other numbers"
            )
        for name, value in (
            ("warmup_epochs", warmup_epochs),
            ("updates_per_epoch", updates_per_epoch),
            ("begin_epoch", begin_epoch),
            ("num_epochs", num_epochs),
        ):
            number("LBSGD", name, value)
        logger.info("Running Large-Batch SGD Algorithm")
        self.warmup_strategy = warmup_strategy
        self.warmup_epochs = warmup_epochs
        self.batch_scale = batch_scale
        self.updates_per_epoch = updates_per_epoch
        self.init_updates = begin_epoch * updates_per_epoch
        self.num_epochs = num_epochs
        self.lbmult = 1
        self.cumgrads: dict = {}
        self.adaptive = False
        self.admult = 1
        self.lazy_update = True  # sgd_update's lazy row-sparse kernel
        self._lr_read: dict = {}

    def _repr_args(self) -> dict[str, object]:
        return {
            "learning_rate": self.lr,
            "momentum": self.momentum,
            "warmup_strategy": self.warmup_strategy,
        }

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum > 0 else ()

    def check_row_sparse(self, inputs: tuple[float, ...]) -> None:  # noqa: ARG002
        if self.warmup_strategy == "lars":
            raise OptimizerArgumentError(
                "LBSGD: warmup_strategy='lars' with row-sparse gradients: its multiplier "
                "takes the norm of the whole weight, which jaxkv's row-sparse kernels do not "
                "see; expected dense gradients or another warmup_strategy"
            )

    def _update_count(self, index: Any) -> None:
        # MXNet's LBSGD.update reads the learning rate before it counts the update.
        for idx in index if isinstance(index, list | tuple) else [index]:
            self._lr_read[idx] = self._get_lr(idx)
            super()._update_count(idx)

    def _host_state(self) -> Any:
        return dict(self._lr_read)

    def _host_entry(self, index: Any) -> Any:
        return self._lr_read.get(index, ABSENT)

    def _set_host_entry(self, index: Any, entry: Any) -> None:
        if entry is ABSENT:
            self._lr_read.pop(index, None)
        else:
            self._lr_read[index] = entry

    def _set_host_state(self, state: Any) -> None:
        self._lr_read = dict(state)

    def inputs(self, index: Any) -> tuple[float, ...]:
        lr, *rest = super().inputs(index)
        lr = self._lr_read.get(index, lr)
        return (lr, *rest, lr - float(np.float32(lr)))  # lr_lo: lr's float64 rest

    @staticmethod
    def _lars_lr(w: jax.Array, g: jax.Array, s: Scalars, z: jax.Array) -> jax.Array:
        """``float32(lr * clip(sqrt(|w|**2 / (|g|**2 + wd * |w|**2 + 1e-18)), 0.01, 100))``,
        MXNet's float64 arithmetic in double-float32 from float32 sums of squares."""
        f = jnp.float32
        zero = jnp.zeros((), f)
        w_sq = (f32.sum_of_squares(w, z), zero)
        g_sq = (f32.sum_of_squares(g, z), zero)
        neg = lambda x: (-x[0], -x[1])  # noqa: E731
        decay = f32.mul((jnp.asarray(s["wd"], f), zero), w_sq, z)
        below = f32.sub(f32.sub(g_sq, neg(decay), z), neg(f32.pair(1e-18)), z)
        root = f32.sqrt_pair(f32.div(w_sq, below, z), z)
        low, high = f32.pair(0.01), f32.pair(100.0)
        below_low, above_high = root[0] < low[0], root[0] > high[0]
        root = (jnp.where(below_low, low[0], root[0]), jnp.where(below_low, low[1], root[1]))
        root = (jnp.where(above_high, high[0], root[0]), jnp.where(above_high, high[1], root[1]))
        lr = (jnp.asarray(s["lr"], f), jnp.asarray(s["lr_lo"], f))
        return f32.mul(lr, root, z)[0]

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
        # From the second update on MXNet's cumulated gradient is 0 + grad.
        g = jnp.where(t == self.begin_num_update + 1, g, jnp.where(g == 0, jnp.zeros_like(g), g))
        lr = jnp.asarray(s["lr"], jnp.float32)
        if self.warmup_strategy == "lars":  # MXNet's float64, in double-float32
            lr = self._lars_lr(w, g, s, z)
        if not slots:
            return sgd_update(g, w, s, z, lr=lr), ()
        step = sgd_step(g, {**s, "lr": lr}, z)
        decay = r(r(cast(lr, d) * cast(s["wd"], d)) * w)
        mom = r(f32.constant(self.momentum, d) * slots[0]) - decay - step
        return mom, (mom,)
