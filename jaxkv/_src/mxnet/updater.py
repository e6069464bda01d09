"""MXNet's ``Updater`` (``mx.optimizer.get_updater``): an optimizer applied by hand to NDArray
weights, one index at a time, as MXNet's updater applies it; given to a store's ``set_updater``
it is that store's ``set_optimizer``."""

from __future__ import annotations

from typing import Any

import jax

from jaxkv._src.core.updater import apply_updates
from jaxkv._src.errors import KVStoreError
from jaxkv._src.mxnet.ndarray import NDArray
from jaxkv._src.mxnet.optimizers.optimizer import Optimizer

__all__ = ["Updater", "get_updater"]


class Updater:
    """``updater(index, grad, weight)`` updates the NDArray ``weight`` in place with MXNet's
    numbers (the optimizer's bookkeeping first, then its kernel), keeping a state per index;
    ``index``, ``grad`` and ``weight`` may also be lists of the same length.

    Args:
      optimizer: a ``jaxkv.mx.optimizer`` optimizer.

    Examples:
      >>> import jaxkv.mx as mx
      >>> update = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.5))
      >>> w = mx.nd.ones((2,))
      >>> update(0, mx.nd.array([1.0, -1.0]), w)
      >>> w.asnumpy()
      array([0.5, 1.5], dtype=float32)
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise KVStoreError(
                "get_updater: expected a jaxkv.mx.optimizer optimizer, given "
                f"{type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.states: dict[Any, Any] = {}
        self._step = jax.jit(self._update)

    def _update(self, grad: jax.Array, state: Any, weight: jax.Array, scalars: Any) -> Any:
        tx = self.optimizer.transformation()
        updates, state = tx.update(grad, state, weight, scalars=scalars)
        return apply_updates(weight, updates), state

    def __call__(self, index: Any, grad: Any, weight: Any) -> None:
        indices = list(index) if isinstance(index, list | tuple) else [index]
        grads = list(grad) if isinstance(index, list | tuple) else [grad]
        weights = list(weight) if isinstance(index, list | tuple) else [weight]
        if not len(indices) == len(grads) == len(weights):
            raise KVStoreError(
                f"updater: expected as many gradients and weights as indices ({len(indices)}), "
                f"given {len(grads)} and {len(weights)}"
            )
        for w in weights:
            if not isinstance(w, NDArray):
                raise KVStoreError(
                    f"updater: expected NDArray weights (updated in place), given "
                    f"{type(w).__name__}"
                )
        tx = self.optimizer.transformation()
        for i, g, w in zip(indices, grads, weights):
            value = w.asjax()
            g = g.asjax() if isinstance(g, NDArray) else jax.numpy.asarray(g)
            if tuple(g.shape) != tuple(value.shape):
                raise KVStoreError(
                    f"index {i!r}: expected a gradient of the weight's shape "
                    f"{tuple(value.shape)}, given {tuple(g.shape)}"
                )
            state = self.states.get(i)
            if state is None:
                state = tx.init(value)
            scalars = self.optimizer.next_update([i])[0]
            new, self.states[i] = self._step(g.astype(value.dtype), state, value, scalars)
            w.set_value(new, w.jax_device())

    def get_states(self, dump_optimizer: bool = False) -> bytes:
        """MXNet pickles its states here; jaxkv never pickles: refused."""
        raise KVStoreError(
            f"get_states(dump_optimizer={dump_optimizer}): jaxkv does not pickle optimizer "
            "states; save them through the store (kv.save_optimizer_states)"
        )

    def set_states(self, states: bytes) -> None:
        """MXNet unpickles its states here; jaxkv never unpickles: refused."""
        raise KVStoreError(
            "set_states: jaxkv does not unpickle optimizer states; load them through the store "
            "(kv.load_optimizer_states)"
        )


def get_updater(optimizer: Optimizer) -> Updater:
    """``mx.optimizer.get_updater``: an ``Updater`` of ``optimizer``: ``updater(index, grad,
    weight)`` updates the NDArray ``weight`` in place with MXNet's numbers (see the class)."""
    return Updater(optimizer)
