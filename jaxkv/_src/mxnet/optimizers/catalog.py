"""Every MXNet optimizer jaxkv has, registered for ``create``: importing this module fills the
registry (and names what MXNet 1.9.1's ``mx.optimizer`` has that jaxkv does not)."""

from __future__ import annotations

from jaxkv._src.mxnet.optimizers.adam import Adam
from jaxkv._src.mxnet.optimizers.adam_family import FTML, LAMB, Adamax, Nadam
from jaxkv._src.mxnet.optimizers.adaptive import AdaDelta, AdaGrad, Ftrl, GroupAdaGrad, RMSProp
from jaxkv._src.mxnet.optimizers.momentum import DCASGD, LARS, LBSGD, NAG, SGLD, Signum
from jaxkv._src.mxnet.optimizers.sgd import SGD, Test, ccSGD

__all__ = [
    "DCASGD",
    "FTML",
    "LAMB",
    "LARS",
    "LBSGD",
    "MXNET_NAMES",
    "NAG",
    "SGD",
    "SGLD",
    "AdaDelta",
    "AdaGrad",
    "Adam",
    "Adamax",
    "Ftrl",
    "GroupAdaGrad",
    "Nadam",
    "RMSProp",
    "Signum",
    "Test",
    "ccSGD",
]

# The public names of MXNet 1.9.1's mx.optimizer (its __all__).
MXNET_NAMES = (
    "AdaDelta",
    "AdaGrad",
    "Adam",
    "Adamax",
    "DCASGD",
    "FTML",
    "Ftrl",
    "LAMB",
    "LARS",
    "LBSGD",
    "NAG",
    "NDabs",
    "Nadam",
    "Optimizer",
    "RMSProp",
    "SGD",
    "SGLD",
    "Signum",
    "Test",
    "Updater",
    "ccSGD",
    "create",
    "get_updater",
    "register",
)
