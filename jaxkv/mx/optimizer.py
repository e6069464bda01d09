"""``mx.optimizer``: MXNet 1.9.1's ``SGD``, ``Adam`` and ``Test`` (and ``create``), for
``kv.set_optimizer``.

They give MXNet's numbers (see :mod:`jaxkv._src.mxnet.optimizer` for the formulas and what
``lazy_update`` means for row-sparse gradients). MXNet's other optimizers (``RMSProp``, ``NAG``,
...) are not here: asking for one raises :class:`MissingOptimizerError`, which is both a
``jaxkv.KVStoreError`` and an ``AttributeError``.
"""

from __future__ import annotations

from jaxkv._src.mxnet.optimizer import MXNET_MISSING_NAMES as _MXNET_MISSING_NAMES
from jaxkv._src.mxnet.optimizer import SGD as SGD
from jaxkv._src.mxnet.optimizer import Adam as Adam
from jaxkv._src.mxnet.optimizer import AdamState as AdamState
from jaxkv._src.mxnet.optimizer import MissingOptimizerError as MissingOptimizerError
from jaxkv._src.mxnet.optimizer import Optimizer as Optimizer
from jaxkv._src.mxnet.optimizer import OptimizerArgumentError as OptimizerArgumentError
from jaxkv._src.mxnet.optimizer import SGDState as SGDState
from jaxkv._src.mxnet.optimizer import Test as Test
from jaxkv._src.mxnet.optimizer import TestState as TestState
from jaxkv._src.mxnet.optimizer import UnknownOptimizerError as UnknownOptimizerError
from jaxkv._src.mxnet.optimizer import ccSGD as ccSGD
from jaxkv._src.mxnet.optimizer import create as create
from jaxkv._src.mxnet.optimizer import missing as _missing

__all__ = [
    "SGD",
    "Adam",
    "AdamState",
    "MissingOptimizerError",
    "Optimizer",
    "OptimizerArgumentError",
    "SGDState",
    "Test",
    "TestState",
    "UnknownOptimizerError",
    "ccSGD",
    "create",
]


def __getattr__(name: str) -> object:
    if name in _MXNET_MISSING_NAMES:
        raise _missing(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
