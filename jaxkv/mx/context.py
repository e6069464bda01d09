"""``mx.context``: ``Context``, ``cpu``, ``gpu``, ``current_context``."""

from jaxkv._src.devices import Context as Context
from jaxkv._src.devices import cpu as cpu
from jaxkv._src.devices import current_context as current_context
from jaxkv._src.devices import gpu as gpu

__all__ = ["Context", "cpu", "current_context", "gpu"]
