"""``mx.optimizer``: MXNet 1.9.1's optimizers (``create``, the classes by their MXNet names,
``register``), for ``kv.set_optimizer``, with MXNet's numbers.

See :mod:`jaxkv._src.mxnet.optimizer` for how each runs: MXNet's bookkeeping (update counts,
schedules, multipliers) on the host at each push, its kernel as an optax transformation. A name
MXNet has and jaxkv does not raises :class:`MissingOptimizerError`, which is both a
``jaxkv.KVStoreError`` and an ``AttributeError``.
"""

from __future__ import annotations

from jaxkv._src.mxnet import optimizers as _optimizers
from jaxkv._src.mxnet.optimizer import LearningRateError as LearningRateError
from jaxkv._src.mxnet.optimizer import MissingOptimizerError as MissingOptimizerError
from jaxkv._src.mxnet.optimizer import Optimizer as Optimizer
from jaxkv._src.mxnet.optimizer import OptimizerArgumentError as OptimizerArgumentError
from jaxkv._src.mxnet.optimizer import OptimizerState as OptimizerState
from jaxkv._src.mxnet.optimizer import UnknownOptimizerError as UnknownOptimizerError
from jaxkv._src.mxnet.optimizer import create as create
from jaxkv._src.mxnet.optimizer import missing as _missing
from jaxkv._src.mxnet.optimizer import register as register
from jaxkv._src.mxnet.optimizers import DCASGD as DCASGD
from jaxkv._src.mxnet.optimizers import FTML as FTML
from jaxkv._src.mxnet.optimizers import LAMB as LAMB
from jaxkv._src.mxnet.optimizers import LARS as LARS
from jaxkv._src.mxnet.optimizers import LBSGD as LBSGD
from jaxkv._src.mxnet.optimizers import NAG as NAG
from jaxkv._src.mxnet.optimizers import SGD as SGD
from jaxkv._src.mxnet.optimizers import SGLD as SGLD
from jaxkv._src.mxnet.optimizers import AdaDelta as AdaDelta
from jaxkv._src.mxnet.optimizers import AdaGrad as AdaGrad
from jaxkv._src.mxnet.optimizers import Adam as Adam
from jaxkv._src.mxnet.optimizers import Adamax as Adamax
from jaxkv._src.mxnet.optimizers import Ftrl as Ftrl
from jaxkv._src.mxnet.optimizers import GroupAdaGrad as GroupAdaGrad
from jaxkv._src.mxnet.optimizers import Nadam as Nadam
from jaxkv._src.mxnet.optimizers import RMSProp as RMSProp
from jaxkv._src.mxnet.optimizers import Signum as Signum
from jaxkv._src.mxnet.optimizers import Test as Test
from jaxkv._src.mxnet.optimizers import ccSGD as ccSGD
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
    if name in _optimizers.MXNET_NAMES:
        raise _missing(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
