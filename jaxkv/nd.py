"""MXNet-style NDArrays: ``jaxkv.nd.ones((2, 3), jaxkv.cpu(1))`` and friends.

``jaxkv.nd.sparse`` holds MXNet's row-sparse arrays (``row_sparse_array``, ``zeros``,
``RowSparseNDArray``, ...); like ``os.path``, it is a module reached as an attribute, and
``import jaxkv.nd.sparse`` works too. ``jaxkv.nd.random`` is one too: MXNet's random draws
(``uniform``, ``normal``, ``randint``, ``randn``, ``shuffle``), seeded by ``mx.random.seed``;
``random_uniform`` and ``random_normal`` are MXNet's operators of those names.
"""

import sys

from jaxkv._src.mxnet import random as random
from jaxkv._src.mxnet import sparse as sparse
from jaxkv._src.mxnet.ndarray import NDArray as NDArray
from jaxkv._src.mxnet.ndarray import arange as arange
from jaxkv._src.mxnet.ndarray import array as array
from jaxkv._src.mxnet.ndarray import empty as empty
from jaxkv._src.mxnet.ndarray import full as full
from jaxkv._src.mxnet.ndarray import ones as ones
from jaxkv._src.mxnet.ndarray import waitall as waitall
from jaxkv._src.mxnet.ndarray import zeros as zeros
from jaxkv._src.mxnet.random import random_normal as random_normal
from jaxkv._src.mxnet.random import random_uniform as random_uniform

sys.modules[__name__ + ".sparse"] = sparse
sys.modules[__name__ + ".random"] = random

__all__ = [
    "NDArray",
    "arange",
    "array",
    "empty",
    "full",
    "ones",
    "random",
    "random_normal",
    "random_uniform",
    "sparse",
    "waitall",
    "zeros",
]
