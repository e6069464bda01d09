"""``mx.optimizer``: MXNet 1.9.1's optimizers (``create``, the classes by their MXNet names,
``register``), for ``kv.set_optimizer``, with MXNet's numbers.

See :mod:`jaxkv._src.mxnet.optimizers.optimizer` for how each runs: MXNet's bookkeeping (update
counts, schedules, multipliers) on the host at each push, its kernel as an optax transformation. A
name MXNet has and jaxkv does not raises :class:`MissingOptimizerError`, which is both a
``jaxkv.KVStoreError`` and an ``AttributeError``.
"""

from __future__ import annotations

from jaxkv._src.mxnet.optimizers import catalog as _catalog
from jaxkv._src.mxnet.optimizers.catalog import DCASGD as DCASGD
from jaxkv._src.mxnet.optimizers.catalog import FTML as FTML
from jaxkv._src.mxnet.optimizers.catalog import LAMB as LAMB
from jaxkv._src.mxnet.optimizers.catalog import LARS as LARS
from jaxkv._src.mxnet.optimizers.catalog import LBSGD as LBSGD
from jaxkv._src.mxnet.optimizers.catalog import NAG as NAG
from jaxkv._src.mxnet.optimizers.catalog import SGD as SGD
from jaxkv._src.mxnet.optimizers.catalog import SGLD as SGLD
from jaxkv._src.mxnet.optimizers.catalog import AdaDelta as AdaDelta
from jaxkv._src.mxnet.optimizers.catalog import AdaGrad as AdaGrad
from jaxkv._src.mxnet.optimizers.catalog import Adam as Adam
from jaxkv._src.mxnet.optimizers.catalog import Adamax as Adamax
from jaxkv._src.mxnet.optimizers.catalog import Ftrl as Ftrl
from jaxkv._src.mxnet.optimizers.catalog import GroupAdaGrad as GroupAdaGrad
from jaxkv._src.mxnet.optimizers.catalog import Nadam as Nadam
from jaxkv._src.mxnet.optimizers.catalog import RMSProp as RMSProp
from jaxkv._src.mxnet.optimizers.catalog import Signum as Signum
from jaxkv._src.mxnet.optimizers.catalog import Test as Test
from jaxkv._src.mxnet.optimizers.catalog import ccSGD as ccSGD
from jaxkv._src.mxnet.optimizers.optimizer import LearningRateError as LearningRateError
from jaxkv._src.mxnet.optimizers.optimizer import MissingOptimizerError as MissingOptimizerError
from jaxkv._src.mxnet.optimizers.optimizer import Optimizer as Optimizer
from jaxkv._src.mxnet.optimizers.optimizer import OptimizerArgumentError as OptimizerArgumentError
from jaxkv._src.mxnet.optimizers.optimizer import OptimizerState as OptimizerState
from jaxkv._src.mxnet.optimizers.optimizer import UnknownOptimizerError as UnknownOptimizerError
from jaxkv._src.mxnet.optimizers.optimizer import create as create
from jaxkv._src.mxnet.optimizers.optimizer import missing as _missing
from jaxkv._src.mxnet.optimizers.optimizer import register as register
from jaxkv._src.mxnet.updater import Updater as Updater
from jaxkv._src.mxnet.updater import get_updater as get_updater

__all__ = [
    "DCASGD",
    "FTML",
    "LAMB",
    "LARS",
    "LBSGD",
    "NAG",
    "SGD",
    "SGLD",
    "AdaDelta",
    "AdaGrad",
    "Adam",
    "Adamax",
    "Ftrl",
    "GroupAdaGrad",
    "LearningRateError",
    "MissingOptimizerError",
    "Nadam",
    "Optimizer",
    "OptimizerArgumentError",
    "OptimizerState",
    "RMSProp",
    "Signum",
    "Test",
    "UnknownOptimizerError",
    "Updater",
    "ccSGD",
    "create",
    "get_updater",
    "register",
]


def __getattr__(name: str) -> object:
    if name in _catalog.MXNET_NAMES:
        raise _missing(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
