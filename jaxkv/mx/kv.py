"""``mx.kv``: ``create`` and ``KVStore``."""

from jaxkv._src.mxnet.kvstore import KVStore as KVStore
from jaxkv._src.mxnet.kvstore import create as create

__all__ = ["KVStore", "create"]
