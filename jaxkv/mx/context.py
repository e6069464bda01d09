"""``mx.context``: ``Context``, ``cpu``, ``gpu``, ``current_context``."""

from jaxkv._context import Context as Context
from jaxkv._context import cpu as cpu
from jaxkv._context import current_context as current_context
from jaxkv._context import gpu as gpu

__all__ = ["Context", "cpu", "current_context", "gpu"]
