"""The MXNet drop-in: ``import jaxkv.mx as mx`` and MXNet KVStore code runs unchanged.

Provides ``mx.kv.create``, ``mx.nd.*``, ``mx.cpu``, ``mx.gpu``, ``mx.Context``,
``mx.context.current_context`` and ``mx.optimizer`` (MXNet's ``SGD`` and ``Adam``, with its
numbers, for ``kv.set_optimizer``).
"""

from .. import nd as nd
from .._context import Context as Context
from .._context import cpu as cpu
from .._context import current_context as current_context
from .._context import gpu as gpu
from .._errors import KVStoreError as MXNetError
from . import context as context
from . import kv as kv
from . import optimizer as optimizer

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
