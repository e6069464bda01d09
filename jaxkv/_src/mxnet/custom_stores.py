"""MXNet's ``KVStoreBase``: the interface of a store written in Python, and its registry.

As in MXNet 1.9.1, a class decorated with ``@KVStoreBase.register`` is registered under its
class name in lower case, and ``mx.kv.create(name)`` makes one (``cls()``) before it looks for
a built-in store type of that name. Registering a name again replaces the class, with a
``UserWarning`` (MXNet's). MXNet's own ``'teststore'`` (``TestStore``, which sums ``pushpull``'s
values on the host and has no optimizer) is registered here too, as MXNet registers it.
"""

from __future__ import annotations

import abc
import builtins
import warnings
from typing import Any, ClassVar

from jaxkv._src.errors import KVStoreError
from jaxkv._src.mxnet.kvstore import KVStore, create_drop_in
from jaxkv._src.mxnet.ndarray import NDArray

__all__ = [
    "CapabilityError",
    "KVStoreBase",
    "RegisterError",
    "StoreNameError",
    "TestStore",
    "create",
]


class StoreNameError(KVStoreError, TypeError):
    """``mx.kv.create`` given a name that is not a ``str`` (MXNet raises ``TypeError``)."""


class RegisterError(KVStoreError, AssertionError):
    """``KVStoreBase.register`` given something that is not a class (MXNet asserts it)."""


class CapabilityError(KVStoreError, ValueError):
    """``is_capable`` given a capability the store does not know (MXNet raises ``ValueError``)."""


# ABCMeta only so that jaxkv's own KVStore counts as one (registered below); nothing is abstract:
# MXNet's methods raise NotImplementedError, and a subclass need not define them all.
class KVStoreBase(metaclass=abc.ABCMeta):  # noqa: B024
    """The interface of a key-value store for data-parallel training (MXNet's ``KVStoreBase``).

    A store written in Python subclasses it, implements the methods it supports (the others
    raise ``NotImplementedError``) and registers itself with :meth:`register`; ``jaxkv.mx``'s
    own stores (``mx.kv.create('device')``) are instances of it too.

    Examples:
      >>> import jaxkv.mx as mx
      >>> @mx.kv.KVStoreBase.register
      ... class EchoStore(mx.kv.KVStoreBase):
      ...     def broadcast(self, key, value, out, priority=0):
      ...         for o in out if isinstance(out, list) else [out]:
      ...             o[:] = value
      >>> kv = mx.kv.create('echostore')
      >>> out = mx.nd.zeros((2,))
      >>> kv.broadcast(3, mx.nd.ones((2,)), out)
      >>> out.asnumpy().tolist(), isinstance(mx.kv.create('local'), mx.kv.KVStoreBase)
      ([1.0, 1.0], True)
    """

    OPTIMIZER = "optimizer"
    kv_registry: ClassVar[dict[str, type]] = {}

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Broadcast ``value`` (rank 0's) to every rank, into ``out``."""
        raise NotImplementedError()

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Sum ``value`` across devices and workers into ``out`` (into ``value`` without it)."""
        raise NotImplementedError()

    def set_optimizer(self, optimizer: Any) -> None:
        """Use ``optimizer`` to update the stored values."""
        raise NotImplementedError()

    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability`` (such as ``OPTIMIZER``, ``'optimizer'``)."""
        raise NotImplementedError()

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Save the optimizer's states to ``fname``."""
        raise NotImplementedError()

    def load_optimizer_states(self, fname: str) -> None:
        """Load the optimizer's states from ``fname``."""
        raise NotImplementedError()

    @property
    def type(self) -> str:
        """The store's type name."""
        raise NotImplementedError()

    @property
    def rank(self) -> int:
        """This worker's rank, in ``[0, num_workers)``."""
        raise NotImplementedError()

    @property
    def num_workers(self) -> int:
        """How many workers share the store."""
        raise NotImplementedError()

    @staticmethod
    def register(klass: builtins.type) -> builtins.type:
        """Register ``klass`` under its name in lower case, for ``mx.kv.create``; returns it,
        so it decorates a class. A name registered before is replaced, with a ``UserWarning``.

        Raises:
          RegisterError: ``klass`` is not a class.
        """
        if not isinstance(klass, type):
            raise RegisterError(
                f"KVStoreBase.register: expected a class, given {type(klass).__name__} {klass!r}"
            )
        name = klass.__name__.lower()
        old = KVStoreBase.kv_registry.get(name)
        if old is not None:
            warnings.warn(
                f"WARNING: New kvstore {klass.__module__}.{klass.__name__} is overriding "
                f"existing kvstore {old.__module__}.{old.__name__}",
                stacklevel=2,
            )
        KVStoreBase.kv_registry[name] = klass
        return klass


# jaxkv's own stores are KVStoreBase's too, as MXNet's KVStore derives from it (the metaclass's
# register: the class's own ``register`` is MXNet's registry).
abc.ABCMeta.register(KVStoreBase, KVStore)


def create(name: str = "local") -> Any:
    """MXNet's ``mx.kv.create``: a new store of the class registered as ``name`` in lower case
    if there is one, else the drop-in's store of that type (``'local'``, ``'device'``,
    ``'dist_sync'``, ...; see :func:`jaxkv.create`).

    Raises:
      StoreNameError: ``name`` is not a ``str``.
      KVStoreError: no class is registered as ``name`` and no store type has that name.

    Examples:
      >>> import jaxkv.mx as mx
      >>> mx.kv.create('TestStore').type, mx.kv.create('Device').type
      ('teststore', 'device')
    """
    if not isinstance(name, str):
        raise StoreNameError(f"KVStore type: expected a str such as 'local', given {name!r}")
    name = name.lower()
    klass = KVStoreBase.kv_registry.get(name)
    return klass() if klass is not None else create_drop_in(name)


def _outs(out: Any) -> list[NDArray]:
    return out if isinstance(out, list) else [out]


@KVStoreBase.register
class TestStore(KVStoreBase):
    """MXNet's test store, ``mx.kv.create('teststore')``: one worker, no optimizer.

    ``broadcast`` copies ``value`` into each out; ``pushpull`` of a list of values sums them on
    the first value's device and writes the sum into each out (into each value when ``out`` is
    ``None``); of a single value, copies it into each out.
    """

    __test__ = False  # (not a test class, for pytest)

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        for o in _outs(out):
            o[:] = value

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        if isinstance(value, NDArray):
            for o in [] if out is None else _outs(out):
                o[:] = value
            return
        ctx = value[0].context
        total = value[0].as_in_context(ctx)
        for v in value[1:]:
            total = total + v.as_in_context(ctx)
        for o in value if out is None else _outs(out):
            o[:] = total

    @staticmethod
    def is_capable(capability: str) -> bool:
        """``False`` for ``'optimizer'``: the test store has none.

        Raises:
          KVStoreError: an unknown capability (a ``ValueError`` too).
        """
        if str(capability).lower() == KVStoreBase.OPTIMIZER:
            return False
        raise CapabilityError(f"unknown capability: expected 'optimizer', given {capability!r}")

    @property
    def type(self) -> str:
        return "teststore"

    @property
    def rank(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return 1
