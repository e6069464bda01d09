"""``mx.random``: ``seed`` and MXNet's random draws (those of ``mx.nd.random``).

After ``mx.random.seed(s)`` the same draws give the same numbers; the numbers are not MXNet's,
their shapes, dtypes, devices and distributions are (see :mod:`jaxkv.nd.random`).
"""

from jaxkv._src.mxnet.random import RandomArgumentError as RandomArgumentError
from jaxkv._src.mxnet.random import RandomAssertionError as RandomAssertionError
from jaxkv._src.mxnet.random import normal as normal
from jaxkv._src.mxnet.random import randint as randint
from jaxkv._src.mxnet.random import randn as randn
from jaxkv._src.mxnet.random import seed as seed
from jaxkv._src.mxnet.random import shuffle as shuffle
from jaxkv._src.mxnet.random import uniform as uniform

__all__ = [
    "RandomArgumentError",
    "RandomAssertionError",
    "normal",
    "randint",
    "randn",
    "seed",
    "shuffle",
    "uniform",
]
