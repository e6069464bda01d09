"""The MXNet drop-in: ``import jaxkv.mx as mx`` and MXNet KVStore code runs unchanged.

Provides ``mx.kv.create``, ``mx.nd.*``, ``mx.cpu``, ``mx.gpu``, ``mx.Context``,
``mx.context.current_context`` and ``mx.optimizer`` (MXNet's ``SGD`` and ``Adam``, with its
numbers, for ``kv.set_optimizer``).
"""

from jaxkv import nd as nd
from jaxkv._src.devices import Context as Context
from jaxkv._src.devices import cpu as cpu
from jaxkv._src.devices import current_context as current_context
from jaxkv._src.devices import gpu as gpu
from jaxkv._src.errors import KVStoreError as MXNetError
from jaxkv.mx import context as context
from jaxkv.mx import kv as kv
from jaxkv.mx import optimizer as optimizer

kvstore = kv
ndarray = nd

__all__ = [
    "Context",
    "MXNetError",
    "context",
    "cpu",
    "current_context",
    "gpu",
    "kv",
    "kvstore",
    "nd",
    "ndarray",
    "optimizer",
]
