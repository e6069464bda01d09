"""``mx.kv``: ``create`` and ``KVStore``."""

from .._kvstore import KVStore as KVStore
from .._kvstore import create as create

__all__ = ["KVStore", "create"]
