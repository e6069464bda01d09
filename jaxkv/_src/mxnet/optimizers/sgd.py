"""MXNet's SGD family as kernels of :class:`~jaxkv._src.mxnet.optimizers.optimizer.Optimizer`:
``SGD`` (and its deprecated alias ``ccSGD``) and the ``'test'`` optimizer of MXNet's own tests."""

from __future__ import annotations

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

__all__ = ["SGD", "Test", "ccSGD"]


def sgd_step(g: jax.Array, s: Scalars, z: jax.Array) -> jax.Array:
    """``lr * clip(rescale_grad * g)``, or without clipping ``(lr * rescale_grad) * g`` (a
    float32 product of the two, as C++), rounded: the gradient step of MXNet's SGD kernels."""
    d = g.dtype
    lr, rescale, c = cast(s["lr"], d), cast(s["rescale_grad"], d), cast(s["clip_gradient"], d)
    with_clip = f32.rounded(lr * clipped(f32.rounded(rescale * g, z), c), z)
    without = f32.rounded(f32.rounded(lr * rescale, z) * g, z)
    return jnp.where(c >= 0, with_clip, without)


@register
class SGD(Optimizer):
    """MXNet's SGD with momentum and weight decay (``mx.optimizer.SGD``).

    With ``lr``, ``wd``, ``rescale_grad``, ``momentum`` and ``clip_gradient`` as float32
    (MXNet's kernels take them as C++ floats), a dense gradient does, as MXNet's
    ``multi_sgd_mom_update`` / ``multi_sgd_update`` (the updater's aggregated path)::

        g = lr * clip(rescale_grad * grad, clip_gradient)   # no clip: (lr * rescale_grad) * grad
        mom = momentum * mom - (lr * wd) * weight - g        # without momentum: mom = 0 first
        weight = weight + mom

    A row-sparse gradient (``transformation(row_sparse=True)``) without momentum does, as
    ``sgd_update``'s row-sparse kernel, ``weight = (1 - lr * wd) * weight - g``, which as an
    update ``w + (new - w)`` is exact unless the step is larger than the weight (then within
    one ulp); with momentum, the formula above. The state's one slot is MXNet's ``mom`` (no
    slot without momentum).

    ``lazy_update=True`` (default): a row-sparse gradient changes only its rows (weight decay
    and momentum too). ``False``: every row, as a dense gradient with zeros elsewhere.

    Args:
      momentum: the momentum (0: none, and no momentum state).
      lazy_update: whether a row-sparse gradient updates only its rows.
      **kwargs: :class:`Optimizer`'s arguments (``learning_rate`` defaults to 0.01).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> opt = optimizer.SGD(learning_rate=0.5, momentum=0.9)
      >>> tx = opt.transformation()
      >>> w = jnp.ones(2)
      >>> state = tx.init(w)
      >>> updates, state = tx.update(jnp.array([1.0, -1.0]), state, w)
      >>> optax.apply_updates(w, updates)
      Array([0.5, 1.5], dtype=float32)
    """

    STATIC: ClassVar[frozenset[str]] = Optimizer.STATIC | {"momentum"}

    def __init__(self, momentum: float = 0.0, lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = number("SGD", "momentum", momentum)
        if self.momentum < 0:
            raise OptimizerArgumentError(
                f"SGD: momentum expected >= 0 (MXNet ignores a negative one), given {momentum!r}"
            )
        self.lazy_update = bool(lazy_update)

    def _repr_args(self) -> dict[str, object]:
        return {
            "learning_rate": self.lr,
            "momentum": self.momentum,
            "lazy_update": self.lazy_update,
        }

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
        d = w.dtype
        lr, wd = cast(s["lr"], d), cast(s["wd"], d)
        step = sgd_step(g, s, z)
        decay = f32.rounded(f32.rounded(lr * wd, z) * w, z)
        if slots:  # mom = momentum * mom - (lr * wd) * weight - g; weight += mom
            kept = f32.rounded(cast(self.momentum, d) * slots[0], z)
            mom = kept - decay - step
            return mom, (mom,)
        if not row_sparse:  # multi_sgd: mom = 0*0 - lr*wd*w - g; w + mom
            return -decay - step, ()
        # sgd_update's row-sparse (1 - lr*wd)*w - g, as an update (exact when wd == 0).
        one = np.ones((), d)
        shrunk = f32.rounded(f32.rounded(one - f32.rounded(lr * wd, z), z) * w, z)
        return jnp.where(wd == 0, -step, f32.rounded(shrunk - step, z) - w), ()


@register
class ccSGD(SGD):  # noqa: N801 - MXNet's name
    """[DEPRECATED in MXNet] Same as :class:`SGD`."""


@register
class Test(Optimizer):
    """MXNet's ``'test'`` optimizer (``mx.optimizer.Test``), which its own KVStore tests set:
    ``weight += grad * rescale_grad``, ignoring the learning rate, weight decay and clipping.

    A row-sparse gradient adds its rows only (as MXNet's ``weight[:] += grad`` of a row-sparse
    gradient does).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from jaxkv.mx import optimizer
      >>> tx = optimizer.create("test", rescale_grad=2).transformation()
      >>> w = jnp.ones(2)
      >>> updates, _ = tx.update(jnp.array([1.0, -1.0]), tx.init(w), w)
      >>> optax.apply_updates(w, updates)
      Array([ 3., -1.], dtype=float32)
    """

    SCALARS: ClassVar[tuple[str, ...]] = ("rescale_grad",)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lazy_update = True

    def _repr_args(self) -> dict[str, object]:
        return {}  # it uses none of the learning rate, wd and clipping

    def inputs(self, index: Any) -> tuple[float, ...]:  # noqa: ARG002 - no multipliers
        return (self.rescale_grad,)

    def _update_count(self, index: Any) -> None:
        """MXNet's ``Test.update`` counts nothing: ``num_update`` stays where it began."""

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
        # MXNet's grad * rescale_grad, rounded on its own, then weight += it.
        return f32.rounded(g * cast(s["rescale_grad"], w.dtype), z), ()
