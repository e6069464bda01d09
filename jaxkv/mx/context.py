"""``mx.context``: ``Context``, ``cpu``, ``gpu``, ``current_context``, ``num_gpus``."""

from jaxkv._src.devices import Context as Context
from jaxkv._src.devices import cpu as cpu
from jaxkv._src.devices import current_context as current_context
from jaxkv._src.devices import gpu as gpu
from jaxkv._src.devices import num_gpus as num_gpus

__all__ = ["Context", "cpu", "current_context", "gpu", "num_gpus"]
