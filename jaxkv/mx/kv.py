"""``mx.kv``: ``create`` and ``KVStore``."""

from jaxkv._kvstore import KVStore as KVStore
from jaxkv._kvstore import create as create

__all__ = ["KVStore", "create"]
