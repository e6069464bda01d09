"""``mx.lr_scheduler``: MXNet 1.9.1's learning-rate schedulers, its numbers bit for bit.

``FactorScheduler``, ``MultiFactorScheduler``, ``PolyScheduler`` and ``CosineScheduler``, and
``LRScheduler`` to subclass, with MXNet's arguments, defaults, state and refusals (see
:mod:`jaxkv._src.mxnet.optimizers.lr_scheduler`). Refusals raise :class:`SchedulerArgumentError` (a
``ValueError``) or :class:`SchedulerAssertionError` (an ``AssertionError``), both
``jaxkv.KVStoreError``.
"""

from __future__ import annotations

from jaxkv._src.mxnet.optimizers.lr_scheduler import CosineScheduler as CosineScheduler
from jaxkv._src.mxnet.optimizers.lr_scheduler import FactorScheduler as FactorScheduler
from jaxkv._src.mxnet.optimizers.lr_scheduler import LRScheduler as LRScheduler
from jaxkv._src.mxnet.optimizers.lr_scheduler import MultiFactorScheduler as MultiFactorScheduler
from jaxkv._src.mxnet.optimizers.lr_scheduler import PolyScheduler as PolyScheduler
from jaxkv._src.mxnet.optimizers.lr_scheduler import (
    SchedulerArgumentError as SchedulerArgumentError,
)
from jaxkv._src.mxnet.optimizers.lr_scheduler import (
    SchedulerAssertionError as SchedulerAssertionError,
)
from jaxkv._src.mxnet.optimizers.lr_scheduler import (
    SchedulerZeroDivisionError as SchedulerZeroDivisionError,
)

__all__ = [
    "CosineScheduler",
    "FactorScheduler",
    "LRScheduler",
    "MultiFactorScheduler",
    "PolyScheduler",
    "SchedulerArgumentError",
    "SchedulerAssertionError",
    "SchedulerZeroDivisionError",
]
