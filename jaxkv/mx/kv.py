"""``mx.kv``: ``create`` and ``KVStore``, the drop-in's store (MXNet's refusals where jaxkv's
own store accepts more), and ``KVStoreBase``, for stores written in Python (``create`` makes a
registered one first, as MXNet's does)."""

from jaxkv._src.mxnet.custom_stores import KVStoreBase as KVStoreBase
from jaxkv._src.mxnet.custom_stores import RegisterError as RegisterError
from jaxkv._src.mxnet.custom_stores import StoreNameError as StoreNameError
from jaxkv._src.mxnet.custom_stores import create as create
from jaxkv._src.mxnet.kvstore import DropInKVStore as KVStore

__all__ = ["KVStore", "KVStoreBase", "RegisterError", "StoreNameError", "create"]
