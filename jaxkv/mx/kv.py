"""``mx.kv``: ``create`` and ``KVStore``, the drop-in's store (MXNet's refusals where jaxkv's
own store accepts more)."""

from jaxkv._src.mxnet.kvstore import DropInKVStore as KVStore
from jaxkv._src.mxnet.kvstore import create_drop_in as create

__all__ = ["KVStore", "create"]
